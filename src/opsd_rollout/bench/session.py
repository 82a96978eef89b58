"""``opsd-rollout bench`` for people: a progress line while it runs (saying what a long first step is doing),
then the table, plots and trace.

Light at import (rich and the result document only): the dry run prints from here; the runner (torch,
DeepSpeed) loads when a run starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from opsd_rollout.bench.contenders import knob_notes
from opsd_rollout.bench.matrix import Matrix, run_order
from opsd_rollout.bench.plots import write_plots
from opsd_rollout.bench.report import ConfigResult, results_of
from opsd_rollout.bench.tables import CompactTable, PhraseText, display_labels, fmt
from opsd_rollout.files import write_json_atomic

MEASURING = "measuring the machine's ceilings"
"""Before the first config of a new result file: a large copy and a large matmul, for utilisation figures."""
BUILDING = "building engine, then first call"
"""A config whose engine (dtype, ZeRO stage) differs from the last one's: loading the model, wrapping it in
DeepSpeed, then its first call."""
FIRST_CALL = "first call (compiles, allocates)"
"""The config's first call: compiling, allocating workspaces and caches, kernel JIT; often the longest."""


class ProgressLine:
    """The run's two progress bars (configs, and the current config's iterations) and what the current
    config is doing before its first measured iteration. The runner reports through ``__call__(event,
    config, iteration)``: ``config`` (a config starts), ``first_call`` (its engine is built; its first call
    starts), ``warmup`` (warm-up call ``iteration`` done), ``iteration``; ``status(text)`` names any other
    long step."""

    def __init__(self, bar: Progress, settings: Any, configs: int, *, first_status: str = "starting"):
        self.bar, self.settings = bar, settings
        self.configs = bar.add_task("configs", total=configs)
        self.iterations = bar.add_task(first_status, total=settings.iterations)
        self.engine_key: Any = None

    def status(self, text: str) -> None:
        """Say what the current config is doing, in its iterations line."""
        self.bar.update(self.iterations, description=text)

    def __call__(self, event: str, config: Any, iteration: int) -> None:
        if event == "config":
            self.bar.update(self.configs, description=f"configs ({config.label})")
            self.bar.reset(self.iterations, total=self.settings.iterations)
            new_engine = getattr(config, "engine_key", None) != self.engine_key
            self.engine_key = getattr(config, "engine_key", None)
            self.status(BUILDING if new_engine else FIRST_CALL)
        elif event == "first_call":
            self.status(FIRST_CALL)
        elif event == "warmup":
            s = self.settings
            limit = f"at most {s.warmup_max_iterations}" if s.warmup is None else str(s.warmup)
            self.status(f"warming up: {iteration} of {limit} calls done")
        elif event == "iteration":
            self.bar.update(self.iterations, completed=iteration, description="iterations")
            if iteration == self.settings.iterations:
                self.bar.advance(self.configs)


def note(kind: str, style: str, label: str, message: str) -> Text:
    """One line about a config (``warning``, ``failed``, ...): plain text, so a ``[`` in the message is not read
    as markup; the console wraps it at its width."""
    return Text.assemble((kind, style), f" {label}: {message}")


def run_bench_session(matrix: Matrix, settings: Any, *, output: str | None, plot_dir: str | None,
                      trace: str | None, existing: dict[str, Any] | None, console: Console,
                      collective_timeout_s: float | None = None) -> int:
    """Runs the matrix; returns the exit status (1 when a config failed). Under a launcher every rank runs
    it and only rank 0 prints and writes files."""
    from opsd_rollout.bench.runner import BenchRunner  # heavy: see the module docstring

    runner = BenchRunner(matrix, settings, output=output, existing=existing,
                         collective_timeout_s=collective_timeout_s)
    if not runner.ranks.is_main:
        console.quiet = True
    for line in knob_notes(matrix):
        console.print(f"note: {line}", markup=False, highlight=False)
    with Progress(TextColumn("{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True, disable=not runner.ranks.is_main) as bar:
        progress = ProgressLine(bar, settings, len(runner.pending),
                                first_status=MEASURING if runner.environment is None else "starting")
        if existing is not None:
            console.print(f"resuming {output}: {len(runner.pending)} of {len(runner.configs)} configs to run")
        results = runner.run(progress)

    console.print(PhraseText(runner.scenario.title(runner.environment, runner.ranks.world_size)))
    for table in runner.scenario.tables(results):
        console.print(table)
    _print_notes(results, console)
    if not runner.ranks.is_main:
        return 0
    if output:
        console.print(f"results: {output}")
    if plot_dir:
        for path in write_plots(results, plot_dir, runner.scenario):
            console.print(f"plot: {path}")
    if trace:
        from opsd_rollout.profiling.trace import chrome_trace  # torch: see the module docstring

        timelines = [(r.config.key, runner.timelines[r.config.key]) for r in results
                     if r.config.key in runner.timelines]
        write_json_atomic(Path(trace), chrome_trace(timelines))
        console.print(f"trace: {trace} (open in ui.perfetto.dev)")
    failed = [r for r in results if r.status == "failed"]
    if failed:
        console.print(f"[red]{len(failed)} config(s) failed; see 'error' in the results[/]")
        return 1
    return 0


def _print_notes(results: list[ConfigResult], console: Console) -> None:
    """Below the tables: each failed or skipped config's error, each warning, each straggling rank."""
    labels = display_labels([r.config for r in results])
    for result in results:
        if result.status in ("failed", "skipped"):
            console.print(note(result.status, "red", labels[result.config.key], str(result.error)))
        for warning in result.warnings:
            console.print(note("warning", "yellow", labels[result.config.key], warning))
    for result in results:
        for stage, skew in (result.skew or {}).items():
            if skew["flagged"] and stage == "total_ms":
                console.print(note("straggler", "yellow", labels[result.config.key],
                                   f"rank {skew['slowest_rank']} took {skew['max_over_median']:.2f}x the median rank"))


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


def print_dry_run(matrix: Matrix, settings: Any, previous: dict[str, Any] | None, console: Console,
                  source: str | None = None) -> None:
    """The expanded matrix in the user's order with the order it runs in, the warm-up and iterations, and an
    estimated duration where a previous result (read from ``source``) has the config."""
    configs = matrix.expand()
    order = {c.key: i for i, c in enumerate(run_order(configs), start=1)}
    before = {r.config.key: r for r in results_of(previous, matrix.scenario.config_type)} if previous else {}
    estimates = {c.key: estimate_seconds(before.get(c.key), settings) for c in configs}
    warmup = (f"warm-up until steady (at most {settings.warmup_max_iterations} calls, "
              f"{settings.warmup_max_seconds:g} s)" if settings.warmup is None else f"{settings.warmup} warm-up calls")
    rows = [([c.key, str(i), str(order[c.key]), fmt(estimates[c.key]) if estimates[c.key] is not None else "-"], None)
            for i, c in enumerate(configs, start=1)]
    console.print(CompactTable(f"{len(configs)} configs on {settings.model}: {warmup}, then {settings.iterations} "
                               "iterations each ('run': the order they run in)", ["config", "#", "run", "est. s"], rows))
    for line in knob_notes(matrix):
        console.print(f"note: {line}", markup=False, highlight=False)
    known = [v for v in estimates.values() if v is not None]
    origin = f" (from {source})" if source else ""
    if known:
        missing = len(configs) - len(known)
        console.print(f"estimated duration: {_duration(sum(known))} for {len(known)} of {len(configs)} configs"
                      + (f" ({missing} without a previous result)" if missing else "")
                      + f", plus loading models and building engines{origin}", markup=False)
    elif source:
        console.print(f"estimated duration: unknown: {source} has no finished result of these configs "
                      "(--estimate-from FILE)", markup=False)
    else:
        console.print("estimated duration: unknown without a previous result of these configs (--estimate-from FILE)")


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{seconds:.1f} s"
