"""``opsd-rollout bench`` for people: a progress bar while it runs, then the table, plots and trace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from opsd_rollout.bench.matrix import Matrix
from opsd_rollout.bench.plots import write_plots
from opsd_rollout.bench.report import display_labels, write_json_atomic
from opsd_rollout.bench.runner import BenchRunner
from opsd_rollout.profiling.trace import chrome_trace


def run_bench_session(matrix: Matrix, settings: Any, *, output: str | None, plot_dir: str | None,
                      trace: str | None, existing: dict[str, Any] | None, console: Console,
                      collective_timeout_s: float | None = None) -> int:
    """Runs the matrix; returns the exit status (1 when a config failed). Under a launcher every rank runs
    it and only rank 0 prints and writes files."""
    runner = BenchRunner(matrix, settings, output=output, existing=existing,
                         collective_timeout_s=collective_timeout_s)
    if not runner.ranks.is_main:
        console.quiet = True
    per_config = settings.warmup + settings.iterations
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not runner.ranks.is_main) as bar:
        configs = bar.add_task("configs", total=len(runner.pending))
        iterations = bar.add_task("iterations", total=per_config)

        def progress(event: str, config: Any, iteration: int) -> None:
            if event == "config":
                bar.update(configs, description=f"configs ({config.label})")
                bar.reset(iterations, total=per_config)
            elif event == "iteration":
                bar.update(iterations, completed=iteration)
                if iteration == per_config:
                    bar.advance(configs)

        if existing is not None:
            console.print(f"resuming {output}: {len(runner.pending)} of {len(runner.configs)} configs to run")
        results = runner.run(progress)

    console.print(runner.scenario.table(results, runner.scenario.title(runner.environment, runner.ranks.world_size)))
    labels = display_labels([r.config for r in results])
    for result in results:
        for warning in result.warnings:
            console.print(f"[yellow]warning[/] {labels[result.config.key]}: {warning}")
    for result in results:
        for stage, skew in (result.skew or {}).items():
            if skew["flagged"] and stage == "total_ms":
                console.print(f"[yellow]straggler[/] {labels[result.config.key]}: rank {skew['slowest_rank']} took "
                              f"{skew['max_over_median']:.2f}x the median rank")
    if not runner.ranks.is_main:
        return 0
    if output:
        console.print(f"results: {output}")
    if plot_dir:
        for path in write_plots(results, plot_dir, runner.scenario):
            console.print(f"plot: {path}")
    if trace:
        timelines = [(r.config.key, runner.timelines[r.config.key]) for r in results
                     if r.config.key in runner.timelines]
        write_json_atomic(Path(trace), chrome_trace(timelines))
        console.print(f"trace: {trace} (open in ui.perfetto.dev)")
    failed = [r for r in results if r.status == "failed"]
    if failed:
        console.print(f"[red]{len(failed)} config(s) failed; see 'error' in the results[/]")
        return 1
    return 0
