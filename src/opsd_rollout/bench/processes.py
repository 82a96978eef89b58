"""Every config measured in several fresh processes (``--processes K``): the times of one process share its memory
layout, thread placement and clock state, so its iterations say how much a config varies inside a process and
nothing of the 5-20% by which two processes of the same code differ. ``compare`` needs the second to judge a change
(``bench/compare.py``).

``ProcessRunner`` is the run: it starts a worker (this same command with ``--worker-job FILE``) that measures every
config still short of K processes, in run order, each warmed up as in a single-process run, then the next worker,
until every config has its K; so process k of every config runs in the k-th stretch of the run, and drift spreads
over every config and contender alike (with ``--interleave`` a workload's contenders still run round by round inside
each worker). A worker is a ``BenchRunner`` over its configs (``run_worker``): it writes its own result document and
reports its progress on stdout; the run reads the document back and keeps each config's process record apart
(``ConfigResult.processes``), with their merged view (``merge_processes``), rewritten atomically after every worker,
so an interrupted run resumes where it stopped (``--resume-results``).

Why not pyperf's worker machinery, which pioneered this for Python benchmarks: its manager spawns every process of
one benchmark before the next benchmark starts, so it cannot spread processes across configs and contenders; a pyperf
run holds one series of floats (seconds per loop, calibrated), where an iteration here is a profile of dozens of named
figures that ``compare`` judges one by one; its worker is the calling script re-run under pyperf's own command line
(one ``Runner`` per process owning ``sys.argv``), which our subcommands, config files, resume and ``--nproc``
relaunch would have to be rebuilt around; and the parts that spawn and read workers are private (``pyperf._manager``).
What is taken from it is the design: fresh workers, a few values each, every worker's values kept apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from opsd_rollout.bench.contenders import set_run_baselines
from opsd_rollout.bench.matrix import Matrix, run_order
from opsd_rollout.bench.report import ConfigResult, results_of, run_document
from opsd_rollout.bench.stability import Interference, between_warning, merge_sequential
from opsd_rollout.bench.stats import is_number, median
from opsd_rollout.files import write_json_atomic

MARK = "@opsd-rollout-progress "
"""A worker's progress line on its stdout: this, then ``[event, config key, iteration]`` as JSON."""

Launcher = Callable[[Path, Callable[[str], None]], tuple[int, str]]
"""``launch(job, line)``: run a worker on the job file ``job``, each line it prints to ``line``; its exit status and
the tail of what it printed on stderr."""


def subprocess_launcher(command: Sequence[str]) -> Launcher:
    """Workers as fresh processes: ``command`` (the interpreter, what runs this benchmark command, its arguments),
    then ``--worker-job FILE``."""

    def launch(job: Path, line: Callable[[str], None]) -> tuple[int, str]:
        with tempfile.TemporaryFile("w+") as stderr:  # a file: a full stderr pipe would block the worker
            worker = subprocess.Popen([*command, "--worker-job", str(job)], stdout=subprocess.PIPE, stderr=stderr,
                                      text=True)
            for text in worker.stdout:
                line(text)
            status = worker.wait()
            stderr.seek(0)
            return status, stderr.read()[-4000:]

    return launch


def worker_command(launch: Sequence[str], argv: Sequence[str]) -> list[str]:
    """This benchmark command again (``launch``: what runs it after the interpreter), as a worker is started."""
    return [sys.executable, *launch, *argv]


def run_worker(job_file: str | Path, scenario: type) -> int:
    """A worker's whole life: the configs the job names, measured by a ``BenchRunner`` in this process, into the
    job's output document; its progress as ``MARK`` lines; the job's trace when it asks for one."""
    from opsd_rollout.bench.runner import BenchRunner  # heavy: only a worker measures

    job = json.loads(Path(job_file).read_text())
    settings = scenario.settings_type(**job["settings"])
    existing = {"environment": job["environment"]} if job["environment"] is not None else None
    runner = BenchRunner(Matrix.parse(scenario, job["matrix"]), settings, output=job["output"], existing=existing,
                         measure_machine=job["measure_machine"], only=job["keys"])

    def progress(event: str, config: Any, iteration: int) -> None:
        print(MARK + json.dumps([event, getattr(config, "key", None), iteration]), flush=True)

    runner.run(progress)
    write_json_atomic(job["output"], {**runner.document(), "pid": os.getpid()})  # which process measured them
    if job.get("trace"):
        runner.write_trace(job["trace"])
    return 0


def _median_figure(values: list[Any]) -> Any:
    numbers = [v for v in values if is_number(v)]
    if numbers:
        return median(numbers)
    return next((v for v in values if v is not None), None)


def merge_processes(result: ConfigResult) -> None:
    """``result``'s merged view of its ``processes``: every iteration in the order they ran, the first process's
    warm-up, the interference of all (disturbed when any process was), each derived figure's median over the
    processes, and every process's warnings (``process k:``) with one on the spread between them."""
    processes = result.processes or []
    result.iterations = [it for process in processes for it in process["iterations"]]
    result.warmup = processes[0]["warmup"] if processes else None
    views = [Interference.from_dict(p["interference"]) for p in processes if p.get("interference")]
    result.interference = merge_sequential(views).to_dict() if views else None
    names = dict.fromkeys(name for process in processes for name in (process.get("derived") or {}))
    result.derived = {name: _median_figure([(p.get("derived") or {}).get(name) for p in processes])
                      for name in names}
    result.warnings = [f"process {index}: {warning}" for index, process in enumerate(processes, start=1)
                       for warning in process.get("warnings") or []]
    warning = between_warning(result.process_medians("total_ms")) if len(processes) > 1 else None
    if warning:
        result.warnings.append(warning)


def process_record(measured: ConfigResult, pid: int | None) -> dict[str, Any]:
    """What worker ``pid`` measured of one config, as its process record."""
    return {"pid": pid, "iterations": measured.iterations, "warmup": measured.warmup,
            "interference": measured.interference, "derived": measured.derived, "warnings": measured.warnings}


class ProcessRunner:
    """Measures every pending config of a matrix in ``settings.processes`` fresh processes (see the module
    docstring); the result document is rewritten after every worker. The session reads it as a ``BenchRunner``."""

    def __init__(self, matrix: Matrix, settings: Any, *, output: str | Path | None, launcher: Launcher,
                 existing: dict[str, Any] | None = None, measure_machine: bool = True, trace: str | None = None):
        from opsd_rollout.distributed import RankInfo

        self.matrix, self.settings, self.output, self.launcher = matrix, settings, output, launcher
        self.scenario = matrix.scenario(settings)
        self.configs = matrix.expand()
        config_type = matrix.scenario.config_type
        previous = {r.config.key: r for r in results_of(existing or {}, config_type)}
        self.results = {c.key: previous.get(c.key) or ConfigResult(config=c) for c in self.configs}
        for result in self.results.values():
            if result.status == "failed":  # a resume retries failures, in every process
                result.status, result.error, result.iterations, result.warnings = "pending", None, [], []
                result.processes = None
        self.environment = (existing or {}).get("environment")
        self.ranks = RankInfo(0, 1)
        self.timelines: dict[str, list] = {}
        self._measure_machine, self._trace = measure_machine, trace

    @property
    def kind(self) -> str:
        return self.matrix.scenario.kind

    def _missing(self, config: Any) -> int:
        result = self.results[config.key]
        return self.settings.processes - len(result.processes or []) if result.status == "pending" else 0

    @property
    def pending(self) -> list[Any]:
        return [c for c in run_order(self.configs) if self._missing(c) > 0]

    @property
    def runs_pending(self) -> int:
        """Config measurements still to make: one per process each pending config still lacks."""
        return sum(self._missing(c) for c in self.configs)

    def document(self) -> dict[str, Any]:
        return run_document(self, run_order(self.configs))

    def _save(self) -> None:
        if self.output is not None:
            write_json_atomic(self.output, self.document())

    def run(self, progress: Callable[[str, Any, int], None] | None = None) -> list[ConfigResult]:
        progress = progress or (lambda *_: None)
        self._save()
        with tempfile.TemporaryDirectory(prefix="opsd-rollout-workers-") as scratch:
            while self.pending:
                self._run_worker(Path(scratch), self.pending, progress)
                set_run_baselines([self.results[c.key] for c in self.configs], self.matrix, self.settings)
                self._save()
        progress("done", None, 0)
        return [self.results[c.key] for c in self.configs]

    def _run_worker(self, scratch: Path, configs: list[Any], progress: Callable[[str, Any, int], None]) -> None:
        """One worker over ``configs``; what it measured joins each config's processes."""
        number = 1 + min(len(self.results[c.key].processes or []) for c in configs)
        job, output = scratch / f"job-{number}.json", scratch / f"process-{number}.json"
        output.unlink(missing_ok=True)
        write_json_atomic(job, {
            "matrix": self.matrix.to_dict(), "settings": vars(self.settings).copy(), "keys": [c.key for c in configs],
            "environment": self.environment, "measure_machine": self._measure_machine and self.environment is None,
            "output": str(output), "trace": self._trace if number == 1 else None})
        by_key = {c.key: c for c in configs}
        progress("process", None, number)

        def line(text: str) -> None:
            if text.startswith(MARK):
                event, key, iteration = json.loads(text[len(MARK):])
                if event != "done":
                    progress(event, by_key.get(key), iteration)

        status, stderr = self.launcher(job, line)
        document = json.loads(output.read_text()) if output.is_file() else None
        if self.environment is None and document is not None:
            from opsd_rollout.bench.environment import command_line  # torch: the run has it loaded by now

            self.environment = {**document["environment"], "command": command_line()}
        measured = {r.config.key: r for r in results_of(document or {}, self.matrix.scenario.config_type)}
        pid = (document or {}).get("pid")
        for config in configs:
            self._collect(self.results[config.key], measured.get(config.key), pid, status, stderr)

    def _collect(self, result: ConfigResult, measured: ConfigResult | None, pid: int | None, status: int,
                 stderr: str) -> None:
        number = len(result.processes or []) + 1
        if measured is not None and measured.status == "ok":
            result.processes = [*(result.processes or []), process_record(measured, pid)]
            merge_processes(result)
            if len(result.processes) == self.settings.processes:
                result.status = "ok"
            return
        if measured is not None and measured.status == "skipped":  # its contender cannot: in no process
            result.status, result.error = "skipped", measured.error
            return
        if measured is not None and measured.status == "failed":
            error, warnings = measured.error, measured.warnings
        else:
            last = next((text for text in reversed(stderr.strip().splitlines()) if text.strip()), "no message")
            error, warnings = f"the worker ended (exit status {status}) before measuring it: {last}", []
        result.status, result.error = "failed", f"process {number}: {error}"
        result.iterations, result.processes, result.warnings = [], None, [f"process {number}: {w}" for w in warnings]

    def write_trace(self, path: str | Path) -> bool:
        """The first worker wrote the trace (one measured iteration per config); whether it did."""
        return Path(path).is_file()
