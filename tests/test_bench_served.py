"""A served teacher in ``opsd-rollout step`` (issue 46, part 9): ``--teacher-serving in-process,json,compact`` runs
the step's teacher in process or served by ``serve-teacher`` on loopback, ``--teacher-overlaps`` awaits or overlaps
its answer, ``--split-cores`` keeps a core for the server; the configs of one workload run interleaved, the served
ones report the teacher's latency, wait and hidden share, the server's CPU time is the run's own (not interference),
and a step result written before the axes existed keeps its keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import jsonschema
import psutil
import pytest

from conftest import clean_env, run_named
from opsd_rollout.bench import threads
from opsd_rollout.bench.matrix import Matrix
from opsd_rollout.bench.report import load_schema
from opsd_rollout.bench.scenarios import StepScenario, StepSettings
from opsd_rollout.bench.stability import run_cpu_seconds

SHAPE = {"batch_sizes": [2], "samples_per_prompt": [2], "prompt_lengths": [16], "response_lengths": [8],
         "zero_stages": [0]}


def configs(**axes) -> list:
    return Matrix.parse(StepScenario, {**SHAPE, **axes}).expand()


def test_served_configs_need_a_cache_a_server_sends_and_say_so_in_their_keys():
    made = configs(teacher_serving=["in-process", "json", "compact"], teacher_overlaps=["on", "off"],
                   teacher_caches=["full", "top16"])
    keys = [c.key for c in made]
    base = "B2-n2-P16-R8-fp32-greedy-zero0-static-retain-fwdon-jsd0.5"
    assert keys == [f"{base}-full", f"{base}-top16", f"{base}-top16-servedjson", f"{base}-top16-servedjson-waited",
                    f"{base}-top16-servedcompact", f"{base}-top16-servedcompact-waited"]  # no server sends every logit
    in_process = made[0]
    assert in_process.teacher_overlap is None and not in_process.served  # nothing is awaited or overlapped
    assert made[3].label.endswith("top16 served json waited") and made[4].label.endswith("top16 served compact")


def test_deepspeeds_step_keeps_its_teacher_in_process():
    made = configs(strategies=["static", "deepspeed"], teacher_serving=["compact"], teacher_caches=["top16"])
    deepspeed = [c for c in made if c.strategy == "deepspeed"]
    assert len(deepspeed) == 1 and deepspeed[0].teacher_serving is None and not deepspeed[0].served
    assert [c.served for c in made if c.strategy == "static"] == [True]


@pytest.mark.parametrize("axes,settings,named", [
    ({"teacher_serving": ["compact"]}, {}, "a served teacher sends top-k or sampled log-probabilities"),
    ({}, {"split_cores": True}, "--split-cores keeps a core for a served teacher's server"),
])
def test_a_served_teacher_that_cannot_run_is_refused_before_any_work(axes, settings, named):
    scenario = StepScenario(StepSettings(model="llama-tiny", teacher="llama-tiny", **settings))
    with pytest.raises(ValueError, match=named):
        scenario.check(Matrix.parse(StepScenario, {**SHAPE, **axes}), lambda name: 2048)


def test_keeping_a_core_takes_the_run_off_it_and_says_which(monkeypatch):
    affinity = {0, 1, 2, 3}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(affinity))
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: (affinity.clear(), affinity.update(cores)))
    for name in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    import torch

    before = torch.get_num_threads()
    try:
        shared = threads.share_cores(keep=1)
        assert shared.kept == (3,) and affinity == {0, 1, 2}
        assert shared.source == "kept" and shared.per_rank == torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    affinity.intersection_update({0})
    with pytest.raises(ValueError, match="needs more than 1"):
        threads.keep_cores(1)


def test_the_cpu_time_of_a_process_the_run_started_is_the_runs_own():
    """A served teacher's server works for the run: the interference monitor counts its CPU time as the run's."""
    # the shell's own arithmetic spins (a loop that forked `date` each turn spent its time in those processes, not its
    # own, and on a busy machine never reached the 0.05 s); a clock read every 100,000 turns bounds it at 120 s
    busy = subprocess.Popen(["sh", "-c", "end=$(( $(date +%s) + 120 )); while [ $(date +%s) -lt $end ]; do i=0; "
                             "while [ $i -lt 100000 ]; do i=$((i + 1)); done; done"])
    try:
        deadline = time.monotonic() + 120  # however busy the machine: it gets its 0.05 s of CPU in time
        while sum(psutil.Process(busy.pid).cpu_times()[:2]) < 0.05 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run_cpu_seconds() - time.process_time() >= 0.05
    finally:
        busy.kill()
        busy.wait()


@pytest.mark.slow
def test_in_process_and_served_steps_run_interleaved_on_split_cores(tmp_path):
    output = tmp_path / "served.json"
    started = time.time()
    done = run_named("three tiny OPSD step configs, two with a served teacher (a minute on 2 busy cores)",
                     [sys.executable, "-m", "opsd_rollout", "step", "--student", "llama-tiny", "--teacher",
                      "llama-tiny", "--zero-stages", "0", "--batch-sizes", "2", "--samples-per-prompt", "2",
                      "--prompt-lengths", "16", "--response-lengths", "8", "--teacher-caches", "top16",
                      "--teacher-serving", "in-process,json,compact", "--warmup", "1", "--iterations", "2",
                      "--interleave", "--split-cores", "--output", str(output)], timeout=600, env=clean_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    document = json.loads(output.read_text())
    jsonschema.validate(document, load_schema())
    assert document["settings"]["split_cores"] is True
    environment = document["environment"]
    assert environment["threads_source"] in ("kept", "OMP_NUM_THREADS") and len(environment["kept_cores"]) == 1
    results = {r["config"]["teacher_serving"]: r for r in document["results"]}
    assert list(results) == ["in-process", "json", "compact"]
    for serving, result in results.items():
        assert result["status"] == "ok", result["error"]
        latency = [it["teacher_latency_ms"] for it in result["iterations"]]
        assert all(it["loss"] > 0 for it in result["iterations"])
        if serving == "in-process":
            assert latency == [0.0, 0.0] and "teacher_hidden_share" not in result["derived"]
        else:
            assert all(ms > 0 for ms in latency) and 0 <= result["derived"]["teacher_hidden_share"] <= 1
            assert all(it["teacher_forward_ms"] == 0 for it in result["iterations"])  # the server ran it
    assert "the served teacher (medians)" in done.stdout
    left = [p for p in psutil.process_iter(["cmdline", "create_time"])
            if "serve-teacher" in (p.info["cmdline"] or []) and p.info["create_time"] >= started]
    assert not left, "the run left its teacher servers running"
