"""``opsd-rollout bench`` for people: a progress bar while it runs, then the table, plots and trace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from opsd_rollout.bench.matrix import Matrix, run_order
from opsd_rollout.bench.plots import write_plots
from opsd_rollout.bench.report import ConfigResult, compact_table, display_labels, fmt, results_of, write_json_atomic
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
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not runner.ranks.is_main) as bar:
        configs = bar.add_task("configs", total=len(runner.pending))
        iterations = bar.add_task("iterations", total=settings.iterations)

        def progress(event: str, config: Any, iteration: int) -> None:
            if event == "config":
                bar.update(configs, description=f"configs ({config.label})")
                bar.reset(iterations, total=settings.iterations, description="warming up")
            elif event == "warmup":
                bar.update(iterations, description=f"warming up (call {iteration})")
            elif event == "iteration":
                bar.update(iterations, completed=iteration, description="iterations")
                if iteration == settings.iterations:
                    bar.advance(configs)

        if existing is not None:
            console.print(f"resuming {output}: {len(runner.pending)} of {len(runner.configs)} configs to run")
        results = runner.run(progress)

    console.print(runner.scenario.title(runner.environment, runner.ranks.world_size))
    for table in runner.scenario.tables(results):
        console.print(table)
    labels = display_labels([r.config for r in results])
    for result in results:
        if result.status in ("failed", "skipped"):
            console.print(f"[red]{result.status}[/] {labels[result.config.key]}: {result.error}")
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


def estimate_seconds(result: ConfigResult | None, settings: Any) -> float | None:
    """How long a config takes again, from a previous result of it: its warm-up (as warmed up then, or the
    fixed count at its first call's time) plus the iterations at its median."""
    if result is None or result.status != "ok" or not result.iterations:
        return None
    per_call_s = result.p50("total_ms") / 1e3
    warmup = result.warmup or {}
    if settings.warmup is None:
        warmup_s = warmup.get("seconds") or per_call_s
    else:
        first_s = (warmup.get("first_call_ms") or result.p50("total_ms")) / 1e3
        warmup_s = first_s + max(settings.warmup - 1, 0) * per_call_s if settings.warmup else 0.0
    return warmup_s + settings.iterations * per_call_s


def print_dry_run(matrix: Matrix, settings: Any, previous: dict[str, Any] | None, console: Console) -> None:
    """The expanded matrix in the user's order with the order it runs in, the warm-up and iterations, and an
    estimated duration where a previous result has the config."""
    configs = matrix.expand()
    order = {c.key: i for i, c in enumerate(run_order(configs), start=1)}
    before = {r.config.key: r for r in results_of(previous, matrix.scenario.config_type)} if previous else {}
    estimates = {c.key: estimate_seconds(before.get(c.key), settings) for c in configs}
    warmup = (f"warm-up until steady (at most {settings.warmup_max_iterations} calls, "
              f"{settings.warmup_max_seconds:g} s)" if settings.warmup is None else f"{settings.warmup} warm-up calls")
    rows = [([c.key, str(i), str(order[c.key]), fmt(estimates[c.key]) if estimates[c.key] is not None else "-"], None)
            for i, c in enumerate(configs, start=1)]
    console.print(compact_table(f"{len(configs)} configs on {settings.model}: {warmup}, then {settings.iterations} "
                                "iterations each ('run': the order they run in)", ["config", "#", "run", "est. s"], rows))
    known = [v for v in estimates.values() if v is not None]
    if known:
        missing = len(configs) - len(known)
        console.print(f"estimated duration: {_duration(sum(known))} for {len(known)} of {len(configs)} configs"
                      + (f" ({missing} without a previous result)" if missing else "")
                      + ", plus loading models and building engines")
    else:
        console.print("estimated duration: unknown without a previous result of these configs (--estimate-from FILE)")


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{seconds:.1f} s"
