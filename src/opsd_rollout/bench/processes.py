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

``run_together`` measures several runs (``make perf``'s suites, each a matrix of its own) with the same workers: in
each round one fresh process (``python -m opsd_rollout.bench.processes JOB...``) measures every run's pending configs
in turn, so K processes start K interpreters, not K a run.

Why not pyperf's worker machinery, which pioneered this for Python benchmarks: its manager spawns every process of
one benchmark before the next benchmark starts, so it cannot spread processes across configs and contenders; a pyperf
run holds one series of floats (seconds per loop, calibrated), where an iteration here is a profile of dozens of named
figures that ``compare`` judges one by one; its worker is the calling script re-run under pyperf's own command line
(one ``Runner`` per process owning ``sys.argv``), which our subcommands, config files, resume and ``--nproc``
relaunch would have to be rebuilt around; and the parts that spawn and read workers are private (``pyperf._manager``).
What is taken from it is the design: fresh workers, a few values each, every worker's values kept apart.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
JOB_MARK = "@opsd-rollout-job "
"""A shared worker's line on its stdout before each of its jobs: this, then the job's index among them (so a reader
of its stdout can tell the jobs' progress lines apart)."""

Launcher = Callable[[Path, Callable[[str], None]], tuple[int, str]]
"""``launch(job, line)``: run a worker on the job file ``job``, each line it prints to ``line``; its exit status and
the tail of what it printed on stderr."""


def _run_process(argv: list[str], line: Callable[[str], None], env: dict[str, str] | None = None,
                 cwd: str | Path | None = None) -> tuple[int, str]:
    """Run ``argv`` (in ``env`` and ``cwd``: ``None``, this process's), each line it prints to ``line``; its exit
    status and the tail of its stderr."""
    with tempfile.TemporaryFile("w+") as stderr:  # a file: a full stderr pipe would block the worker
        worker = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, cwd=cwd)
        assert worker.stdout is not None
        for text in worker.stdout:
            line(text)
        status = worker.wait()
        stderr.seek(0)
        return status, stderr.read()[-4000:]


def subprocess_launcher(command: Sequence[str]) -> Launcher:
    """Workers as fresh processes: ``command`` (the interpreter, what runs this benchmark command, its arguments),
    then ``--worker-job FILE``."""
    return lambda job, line: _run_process([*command, "--worker-job", str(job)], line)


def worker_command(launch: Sequence[str], argv: Sequence[str]) -> list[str]:
    """This benchmark command again (``launch``: what runs it after the interpreter), as a worker is started."""
    return [sys.executable, *launch, *argv]


def run_worker(job_file: str | Path, scenario: type | None = None) -> int:
    """A worker's whole life: the configs the job names, measured by a ``BenchRunner`` in this process, into the
    job's output document; its progress as ``MARK`` lines; the job's trace when it asks for one. ``scenario``: the
    job's (``None``: the one it names)."""
    from opsd_rollout.bench.runner import BenchRunner  # heavy: only a worker measures

    job = json.loads(Path(job_file).read_text())
    scenario = scenario or scenario_of(job)
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


def run_shared_worker(job_files: Sequence[str | Path]) -> int:
    """A worker shared by several runs (``run_together``): each job in turn, as its own worker would run it, a
    ``JOB_MARK`` line before each; a job that raises is reported on stderr and the next one runs. Exit status 1 when
    one raised."""
    failed = False
    for index, job_file in enumerate(job_files):
        print(f"{JOB_MARK}{index}", flush=True)
        try:
            run_worker(job_file)
        except Exception:  # one run's failure is its own: the runs after it are measured still
            failed = True
            print(f"job {index} ({job_file}) failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    return 1 if failed else 0


def import_root(scenario: type) -> str | None:
    """The directory ``scenario``'s top-level package is imported from (``src/``, ``site-packages``, or ``scripts/``
    for the developers' kernel benchmarks, which are not installed), for a fresh worker's ``sys.path``."""
    package = sys.modules[scenario.__module__.split(".")[0]]
    where = getattr(package, "__file__", None)
    return str(Path(where).resolve().parent.parent) if where else None


def scenario_of(job: dict[str, Any]) -> type:
    """The scenario class a job names (``module:Class``), imported from the job's ``import_path`` when given."""
    if job.get("import_path") and job["import_path"] not in sys.path:
        sys.path.insert(0, job["import_path"])
    module, _, name = job["scenario"].partition(":")
    return getattr(importlib.import_module(module), name)


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


@dataclass
class WorkerJob:
    """One run's part of a worker: the job file it reads, the document it writes there, the configs it measures."""

    runner: ProcessRunner
    job: Path
    output: Path
    configs: dict[str, Any]
    """The configs, by key."""
    number: int
    """Which process of these configs it is (1, 2, ...)."""

    def reader(self, progress: Callable[[str, Any, int], None]) -> Callable[[str], None]:
        """What takes the worker's stdout, a line at a time: its progress lines to ``progress``."""

        def line(text: str) -> None:
            if text.startswith(MARK):
                event, key, iteration = json.loads(text[len(MARK):])
                if event != "done":
                    progress(event, self.configs.get(key), iteration)

        return line


SharedLauncher = Callable[[list[Path], Callable[[str], None]], tuple[int, str]]
"""``launch(jobs, line)``: run one worker over several job files, each line it prints to ``line``; its exit status and
the tail of what it printed on stderr."""


def shared_subprocess_launcher(interpreter: str = sys.executable, env: dict[str, str] | None = None,
                               cwd: str | Path | None = None) -> SharedLauncher:
    """Shared workers as fresh processes: ``python -m opsd_rollout.bench.processes JOB...`` (in ``env`` and ``cwd``:
    ``None``, this process's; another revision's code is another ``PYTHONPATH``, started in its own tree, since
    ``-m`` puts the working directory first on the path)."""
    return lambda jobs, line: _run_process([interpreter, "-m", "opsd_rollout.bench.processes", *map(str, jobs)], line,
                                           env, cwd)


def run_together(runners: Sequence[ProcessRunner], launch: SharedLauncher) -> None:
    """Several runs (each a matrix of its own, e.g. ``make perf``'s suites) measured by the same fresh processes:
    each round one worker measures, run after run, every config each run still lacks a process of, so a run of K
    processes starts K interpreters, not K a run. The processes stay the units: a config is measured once in each,
    and each run's document is its own, rewritten after every round as ``ProcessRunner.run`` does."""
    run_alternating([(runners, launch)])


def run_alternating(sides: Sequence[tuple[Sequence[ProcessRunner], SharedLauncher]]) -> None:
    """Several sides, each runs measured by fresh processes of its own launcher as ``run_together`` measures them,
    taking turns process by process: round k starts each side's k-th worker, the sides in an order that turns by one
    each round (two sides: A B, B A, A B, ...). A machine that slows between two workers then slows every side
    alike, where two runs one after the other would put the whole drift on one side (``scripts/perf.py --against
    REV``: two revisions in one run)."""
    if not sides:
        return
    for runners, _ in sides:
        for runner in runners:
            runner._save()
    with tempfile.TemporaryDirectory(prefix="opsd-rollout-workers-") as scratch:
        for round_ in itertools.count():
            turn = round_ % len(sides)
            started = False
            for side, (runners, launch) in list(enumerate(sides))[turn:] + list(enumerate(sides))[:turn]:
                jobs = []
                for index, runner in enumerate(runners):
                    folder = Path(scratch) / str(side) / str(index)
                    folder.mkdir(parents=True, exist_ok=True)
                    if (job := runner.next_job(folder)) is not None:
                        jobs.append(job)
                if not jobs:
                    continue
                started = True
                status, stderr = launch([job.job for job in jobs], lambda text: None)  # no progress: what is
                # measured is read back from each job's document
                for job in jobs:
                    job.runner.finish(job, status, stderr)
            if not started:
                return


class ProcessRunner:
    """Measures every pending config of a matrix in ``settings.processes`` fresh processes (see the module
    docstring); the result document is rewritten after every worker. The session reads it as a ``BenchRunner``."""

    def __init__(self, matrix: Matrix, settings: Any, *, output: str | Path | None, launcher: Launcher | None = None,
                 existing: dict[str, Any] | None = None, measure_machine: bool = True, trace: str | None = None,
                 import_path: str | None = None):
        """``import_path``: where a worker imports the scenario's package from (``None``: where this process did,
        ``import_root``); another revision's checkout measures that revision's code."""
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
        self.import_path = import_path or import_root(self.matrix.scenario)

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
        if self.launcher is None:
            raise ValueError("ProcessRunner.run needs a launcher (run_together starts the workers of runs without)")
        progress = progress or (lambda *_: None)
        self._save()
        with tempfile.TemporaryDirectory(prefix="opsd-rollout-workers-") as scratch:
            while (job := self.next_job(Path(scratch))) is not None:
                progress("process", None, job.number)
                status, stderr = self.launcher(job.job, job.reader(progress))
                self.finish(job, status, stderr)
        progress("done", None, 0)
        return [self.results[c.key] for c in self.configs]

    def next_job(self, scratch: Path) -> WorkerJob | None:
        """The next worker's part of this run (its job file written in ``scratch``): every config still short of
        its processes, in run order; ``None`` when every config has them."""
        configs = self.pending
        if not configs:
            return None
        number = 1 + min(len(self.results[c.key].processes or []) for c in configs)
        job, output = scratch / f"job-{number}.json", scratch / f"process-{number}.json"
        output.unlink(missing_ok=True)
        scenario = self.matrix.scenario
        write_json_atomic(job, {
            "scenario": f"{scenario.__module__}:{scenario.__qualname__}", "import_path": self.import_path,
            "matrix": self.matrix.to_dict(), "settings": vars(self.settings).copy(), "keys": [c.key for c in configs],
            "environment": self.environment, "measure_machine": self._measure_machine and self.environment is None,
            "output": str(output), "trace": self._trace if number == 1 else None})
        return WorkerJob(self, job, output, {c.key: c for c in configs}, number)

    def finish(self, job: WorkerJob, status: int, stderr: str) -> None:
        """What the worker measured of ``job`` (its exit status and the tail of its stderr) joins each config's
        processes; the result document is rewritten."""
        document = json.loads(job.output.read_text()) if job.output.is_file() else None
        if self.environment is None and document is not None:
            from opsd_rollout.bench.environment import command_line  # torch: the run has it loaded by now

            self.environment = {**document["environment"], "command": command_line()}
        measured = {r.config.key: r for r in results_of(document or {}, self.matrix.scenario.config_type)}
        pid = (document or {}).get("pid")
        for key in job.configs:
            self._collect(self.results[key], measured.get(key), pid, status, stderr)
        set_run_baselines([self.results[c.key] for c in self.configs], self.matrix, self.settings)
        self._save()

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


if __name__ == "__main__":  # a shared worker (``run_together``): python -m opsd_rollout.bench.processes JOB...
    if not sys.argv[1:]:
        sys.exit("usage: python -m opsd_rollout.bench.processes JOB... (the job files run_together writes)")
    sys.exit(run_shared_worker(sys.argv[1:]))
