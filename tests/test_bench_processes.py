"""Every config in several fresh processes (issue 52, part 1): the run hands each worker the configs still short of
their processes, in run order, keeps each process's iterations apart with their merged view, resumes where it
stopped, records a worker that died or a config that failed in one process, and reports the spread between
processes beside the one inside them.

The orchestration runs on tiny configs with the workers run in this process (``run_worker``, what a worker process
runs, fed by the same job file); one slow test starts real worker processes."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import jsonschema
import pytest

from opsd_rollout.bench.matrix import Matrix
from opsd_rollout.bench.processes import (JOB_MARK, ProcessRunner, merge_processes, run_alternating, run_shared_worker,
                                          run_together, run_worker)
from opsd_rollout.bench.report import ConfigResult, load_document, load_schema
from opsd_rollout.bench.scenarios import RolloutConfig, RolloutScenario, RolloutSettings
from opsd_rollout.bench.tables import stability_table
from opsd_rollout.cli import main
from test_compare import BUSY, QUIET

TINY = {"batch_sizes": [1, 2], "samples_per_prompt": [1], "prompt_lengths": [8], "response_lengths": [4],
        "zero_stages": ["none"]}
B1, B2 = (f"B{b}-n1-P8-R4-fp32-greedy-zeronone-static-retain-fwdon" for b in (1, 2))


class InProcess:
    """A launcher that runs each worker's job here, as a worker process would, and keeps the jobs it was given;
    ``fail`` maps a worker's number (1, 2, ...) to what happens instead: an exception raised, or an exit status
    and stderr with nothing measured."""

    def __init__(self, fail: dict | None = None):
        self.jobs: list[dict] = []
        self.fail = fail or {}

    def __call__(self, job: Path, line) -> tuple[int, str]:
        self.jobs.append(json.loads(job.read_text()))
        instead = self.fail.get(len(self.jobs))
        if isinstance(instead, BaseException):
            raise instead
        if instead is not None:
            return instead
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            status = run_worker(job, RolloutScenario)
        for text in printed.getvalue().splitlines(keepends=True):
            line(text)
        return status, ""


def runner(tmp_path: Path, launcher: InProcess, existing: dict | None = None, processes: int = 3) -> ProcessRunner:
    settings = RolloutSettings(model="llama-tiny", warmup=0, iterations=2, processes=processes)
    return ProcessRunner(Matrix.parse(RolloutScenario, TINY), settings, output=tmp_path / "run.json",
                         launcher=launcher, existing=existing, measure_machine=False)


def test_each_config_is_measured_in_every_process_and_each_process_kept_apart(tmp_path):
    launcher, events = InProcess(), []
    results = runner(tmp_path, launcher).run(lambda event, config, i: events.append((event, config and config.key, i)))
    document = load_document(tmp_path / "run.json")
    jsonschema.validate(document, load_schema())
    assert document["schema_version"] == 5 and document["settings"]["processes"] == 3
    # three workers, one after another, each measuring every config in run order (the largest batch first)
    assert [job["keys"] for job in launcher.jobs] == [[B2, B1]] * 3
    assert [job["environment"] is None for job in launcher.jobs] == [True, False, False]
    assert [e for e in events if e[0] == "process"] == [("process", None, k) for k in (1, 2, 3)]
    assert [e[1] for e in events if e[0] == "config"] == [B2, B1] * 3
    for result, row in zip(results, document["results"]):
        assert result.status == "ok" and result.process_count == 3
        assert [len(p["iterations"]) for p in row["processes"]] == [2, 2, 2]
        assert row["iterations"] == [it for p in row["processes"] for it in p["iterations"]]
        assert {p["pid"] for p in row["processes"]} == {os.getpid()}  # in this process here; a fresh one in a run
        assert len(result.process_medians("total_ms")) == 3 and result.between_spread("total_ms") is not None
        assert result.derived["warmup_iterations"] == 0 and row["summary"]["total_ms"]["count"] == 6
    table = stability_table(results)
    assert "between processes %" in table.headers[-2].replace("\n", " ")


def test_an_interrupted_run_resumes_with_the_processes_it_lacks(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        runner(tmp_path, InProcess(fail={2: KeyboardInterrupt()})).run()
    interrupted = load_document(tmp_path / "run.json")
    assert [(r["status"], len(r["processes"])) for r in interrupted["results"]] == [("pending", 1)] * 2
    first = interrupted["results"][0]["processes"][0]
    launcher = InProcess()
    results = runner(tmp_path, launcher, existing=interrupted).run()
    assert len(launcher.jobs) == 2 and all(r.status == "ok" and r.process_count == 3 for r in results)
    assert results[0].processes[0] == first  # the process measured before the interruption is kept


def test_a_worker_that_dies_fails_its_configs_naming_the_process_and_why(tmp_path):
    launcher = InProcess(fail={2: (1, "Traceback (most recent call last):\n  ...\nRuntimeError: out of memory\n")})
    results = runner(tmp_path, launcher).run()
    assert len(launcher.jobs) == 2  # nothing left to measure: no third worker
    assert {r.status for r in results} == {"failed"}
    assert results[0].error == ("process 2: the worker ended (exit status 1) before measuring it: RuntimeError: out "
                                "of memory")
    assert results[0].iterations == [] and results[0].processes is None


def test_a_config_that_fails_in_one_process_is_failed_and_the_others_go_on(tmp_path, monkeypatch):
    prepare, calls = RolloutScenario.prepare, []

    def failing(self, pool, config):
        calls.append(config.key)
        if config.key == B1 and calls.count(B1) == 2:
            raise RuntimeError("planted failure")
        return prepare(self, pool, config)

    monkeypatch.setattr(RolloutScenario, "prepare", failing)
    launcher = InProcess()
    results = {r.config.key: r for r in runner(tmp_path, launcher).run()}
    assert results[B1].status == "failed" and results[B1].error == "process 2: RuntimeError: planted failure"
    assert results[B2].status == "ok" and results[B2].process_count == 3
    assert [job["keys"] for job in launcher.jobs] == [[B2, B1], [B2, B1], [B2]]


class SharedInProcess:
    """A shared launcher (``run_together``'s) that runs each worker's jobs here, as ``python -m
    opsd_rollout.bench.processes JOB...`` would; keeps each worker's jobs."""

    def __init__(self):
        self.workers: list[list[dict]] = []

    def __call__(self, jobs: list[Path], line) -> tuple[int, str]:
        self.workers.append([json.loads(job.read_text()) for job in jobs])
        printed, errors = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
            status = run_shared_worker(jobs)
        for text in printed.getvalue().splitlines(keepends=True):
            line(text)
        return status, errors.getvalue()


def test_several_runs_are_measured_by_the_same_workers_each_document_its_own(tmp_path):
    """``make perf``'s suites: each worker measures every run's configs in turn, so 3 processes start 3 interpreters
    for both runs; each run's document is as its own ``--processes 3`` run would write it."""
    settings = RolloutSettings(model="llama-tiny", warmup=0, iterations=2, processes=3)
    other = {**TINY, "batch_sizes": [1], "response_lengths": [2]}
    runs = [ProcessRunner(Matrix.parse(RolloutScenario, axes), settings, output=tmp_path / f"{name}.json",
                          measure_machine=False) for name, axes in (("a", TINY), ("b", other))]
    launcher = SharedInProcess()
    run_together(runs, launcher)
    short = B1.replace("R4", "R2")
    assert [[job["keys"] for job in worker] for worker in launcher.workers] == [[[B2, B1], [short]]] * 3
    assert all(job["scenario"] == "opsd_rollout.bench.scenarios.rollout:RolloutScenario"
               for worker in launcher.workers for job in worker)
    for name, keys in (("a", [B2, B1]), ("b", [short])):
        document = load_document(tmp_path / f"{name}.json")
        jsonschema.validate(document, load_schema())
        assert {row["key"] for row in document["results"]} == set(keys)
        assert all(row["status"] == "ok" and len(row["processes"]) == 3 for row in document["results"])


def test_two_sides_take_turns_process_by_process_each_with_its_own_code(tmp_path):
    """``scripts/perf.py --against REV``: two revisions' runs in one invocation, their workers alternating (A B, B A, A B)
    so drift mid-run lands on both; each side's document is whole, and each side's jobs name where its workers
    import the scenario from (another revision's checkout for the other side)."""
    settings = RolloutSettings(model="llama-tiny", warmup=0, iterations=1, processes=3)
    order = []

    def side(name, import_path=None):
        runner = ProcessRunner(Matrix.parse(RolloutScenario, {**TINY, "batch_sizes": [1]}), settings,
                               output=tmp_path / f"{name}.json", measure_machine=False, import_path=import_path)
        launcher = SharedInProcess()

        def launch(jobs, line):
            order.append(name)
            return launcher(jobs, line)
        return runner, launcher, launch

    (head, head_launcher, head_launch), (base, base_launcher, base_launch) = side("head"), side("base", "/elsewhere")
    run_alternating([([head], head_launch), ([base], base_launch)])
    assert order == ["head", "base", "base", "head", "head", "base"]
    assert {job["import_path"] for worker in base_launcher.workers for job in worker} == {"/elsewhere"}
    assert {job["import_path"] for worker in head_launcher.workers for job in worker} == {head.import_path}
    assert head.import_path.endswith("src")
    for name in ("head", "base"):
        document = load_document(tmp_path / f"{name}.json")
        assert all(row["status"] == "ok" and len(row["processes"]) == 3 for row in document["results"])


def test_a_run_that_fails_in_a_shared_worker_leaves_the_others_measured(tmp_path, capsys):
    """One job of a shared worker raising (its scenario cannot be imported) is reported on stderr and fails that
    run's configs alone; the worker goes on to the next job, and exits 1."""
    settings = RolloutSettings(model="llama-tiny", warmup=0, iterations=1, processes=1)
    good, bad = (ProcessRunner(Matrix.parse(RolloutScenario, TINY), settings, output=tmp_path / f"{name}.json",
                               measure_machine=False) for name in ("good", "bad"))
    jobs = []
    for runner_, folder in ((bad, tmp_path / "0"), (good, tmp_path / "1")):
        folder.mkdir()
        jobs.append(runner_.next_job(folder))
    planted = json.loads(jobs[0].job.read_text())
    jobs[0].job.write_text(json.dumps({**planted, "scenario": "no_such_module:Scenario"}))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = run_shared_worker([job.job for job in jobs])
    assert status == 1 and "No module named 'no_such_module'" in capsys.readouterr().err
    assert [text for text in printed.getvalue().splitlines() if text.startswith(JOB_MARK)] == [f"{JOB_MARK}0",
                                                                                                  f"{JOB_MARK}1"]
    for job in jobs:
        job.runner.finish(job, status, "ModuleNotFoundError: No module named 'no_such_module'")
    assert {r.status for r in good.results.values()} == {"ok"}
    assert {r.status for r in bad.results.values()} == {"failed"}
    assert "No module named 'no_such_module'" in next(iter(bad.results.values())).error


def record(totals: list[float], *, interference: dict = QUIET, derived: dict | None = None,
           warnings: tuple[str, ...] = ()) -> dict:
    return {"pid": 1, "iterations": [{"total_ms": t} for t in totals], "warmup": {"iterations": 2},
            "interference": interference, "derived": derived or {}, "warnings": list(warnings)}


def test_the_merged_view_of_a_configs_processes():
    """Iterations in the order they ran; derived figures the median over processes; disturbed when any process
    was, saying which; each process's warnings named; the spread between processes warned of over 10%."""
    result = ConfigResult(config=RolloutConfig(), processes=[
        record([10.0, 10.2], derived={"ttft_ms": 1.0, "kind": "a"}),
        record([13.0, 13.1], interference=BUSY, derived={"ttft_ms": 3.0, "kind": "b"},
               warnings=("total_ms spread (IQR/median) is 12%, over 10%",)),
        record([10.5, 10.4], derived={"ttft_ms": 2.0, "kind": None})])
    merge_processes(result)
    assert [it["total_ms"] for it in result.iterations] == [10.0, 10.2, 13.0, 13.1, 10.5, 10.4]
    assert result.derived == {"ttft_ms": 2.0, "kind": "a"} and result.warmup == {"iterations": 2}
    assert result.disturbed
    assert result.interference["reasons"] == ["process 2: other processes kept 1.3 of 2 cores busy"]
    assert result.interference["wall_seconds"] == pytest.approx(3 * QUIET["wall_seconds"])
    assert result.warnings[0] == "process 2: total_ms spread (IQR/median) is 12%, over 10%"
    assert result.warnings[1].startswith("total_ms spread between processes (IQR/median of their medians) is 14%")
    assert result.spread_flag == "*" and result.process_medians("total_ms") == [10.1, 13.05, 10.45]
    assert result.within_spread("total_ms") == pytest.approx(0.05 / 10.45)  # the median process's IQR/median


@pytest.mark.parametrize("argv,message", [
    (["--processes", "0"], "processes must be an int >= 1; got 0"),
    (["--processes", "2", "--nproc", "2"], "--processes 2 on 2 ranks: several processes a config run on one rank"),
])
def test_bad_process_counts_are_refused_before_any_work(capsys, argv, message):
    assert main(["bench", "--model", "llama-tiny", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow  # starts two worker processes
def test_a_run_in_fresh_processes_end_to_end(tmp_path, capsys):
    output, trace = tmp_path / "run.json", tmp_path / "trace.json"
    assert main(["bench", "--model", "llama-tiny", "--batch-sizes", "1", "--samples-per-prompt", "1,2",
                 "--prompt-lengths", "8", "--response-lengths", "4", "--zero-stages", "none", "--warmup", "0",
                 "--iterations", "2", "--processes", "2", "--output", str(output), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    document = load_document(output)
    jsonschema.validate(document, load_schema())
    pids = [[p["pid"] for p in r["processes"]] for r in document["results"]]
    assert all(len(set(row)) == 2 and os.getpid() not in row for row in pids) and pids[0] == pids[1]
    assert "--worker-job" not in document["environment"]["command"]  # the run's command, not a worker's
    assert "2 iterations in each of 2 fresh processes" in out and "between" in out
    assert json.loads(trace.read_text())["traceEvents"]
