"""``opsd-rollout bench`` on 2 CPU ranks (torchrun, gloo, a free port each time): per-rank profiles gathered
and merged, only rank 0 writing, and a failing rank stopping the whole run with its error; and the same run
under DeepSpeed's launcher, which passes ``--local_rank`` and leaves the ranks to share the cores."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import jsonschema
import pytest

from conftest import clean_env, run_named
from opsd_rollout.bench.report import load_schema
from opsd_rollout.distributed import free_port

ARGS = ["--model", "llama-tiny", "--zero-stages", "3", "--batch-sizes", "1,2", "--samples-per-prompt", "1",
        "--prompt-lengths", "8", "--response-lengths", "6", "--warmup", "0", "--iterations", "2",
        "--collective-timeout", "600", "--nproc", "2"]


def run_cli(args, tmp_path, extra_env=None, timeout=1500):
    """The CLI on 2 ranks (about 15 s on 2 quiet cores); the timeout outlasts the collectives' own 600 s."""
    env = {**clean_env(), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **(extra_env or {})}
    return run_named(f"opsd-rollout {args[0]} on 2 ranks", [sys.executable, "-m", "opsd_rollout", *args], env=env,
                     timeout=timeout, cwd=tmp_path)


@pytest.mark.slow
def test_two_rank_zero3_bench_gathers_and_merges_both_ranks(tmp_path):
    output = tmp_path / "run.json"
    result = run_cli(["bench", *ARGS, "--output", str(output)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("llama-tiny on cpu") == 1, "only rank 0 prints"
    assert "batch sizes are per rank" in result.stdout
    document = json.loads(output.read_text())
    jsonschema.validate(document, load_schema())
    assert document["environment"]["world_size"] == 2
    assert [r["config"]["batch_size"] for r in document["results"]] == [1, 2]
    for config in document["results"]:
        assert config["status"] == "ok"
        ranks = config["per_rank"]
        assert [r["rank"] for r in ranks] == [0, 1]
        for i, merged in enumerate(config["iterations"]):
            per = [r["iterations"][i] for r in ranks]
            assert merged["total_ms"] == max(p["total_ms"] for p in per)  # latency: the slowest rank
            assert merged["tokens_per_second"] == sum(p["tokens_per_second"] for p in per)  # throughput: summed
            assert merged["generated_tokens"] == sum(p["generated_tokens"] for p in per)
            assert merged["peak_memory_bytes"] == max(p["peak_memory_bytes"] for p in per)
            assert all(p["world_size"] == 2 and p["zero_stage"] == 3 for p in per)
            assert {p["rank"] for p in per} == {0, 1}
        skew = config["skew"]["total_ms"]
        assert skew["slowest_rank"] in (0, 1) and skew["max_over_median"] >= 1.0
        assert len(skew["rank_medians_ms"]) == 2
    assert not list(tmp_path.glob("bench-results*")), "no rank wrote anything but the requested output"


@pytest.mark.slow
def test_a_rank_that_fails_stops_the_run_with_its_error(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(textwrap.dedent('''
        import os
        if os.environ.get("RANK") == "1":  # rank 1 fails on its second rollout
            import opsd_rollout.rollout.engine as engine
            original, calls = engine.HybridEngineRollout.generate, []
            def failing(self, request, sampling, **kwargs):
                calls.append(1)
                if len(calls) == 2:
                    raise RuntimeError("planted failure on rank 1")
                return original(self, request, sampling)
            engine.HybridEngineRollout.generate = failing
    '''))
    output = tmp_path / "run.json"
    result = run_cli(["bench", *ARGS, "--output", str(output)], tmp_path,
                     extra_env={"PYTHONPATH": f"{hook}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    text = result.stdout + result.stderr
    assert result.returncode != 0
    assert "rank 1 failed on config" in text and "planted failure on rank 1" in text


@pytest.mark.slow
def test_two_rank_opsd_step(tmp_path):
    output = tmp_path / "step.json"
    result = run_cli(["step", "--teacher", "qwen2-tiny", "--zero-stages", "3", "--batch-sizes", "1",
                      "--prompt-lengths", "8", "--response-lengths", "6", "--warmup", "0", "--iterations", "2",
                      "--collective-timeout", "600", "--nproc", "2", "--output", str(output)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads(output.read_text())
    jsonschema.validate(document, load_schema())
    (config,) = document["results"]
    assert document["kind"] == "step" and config["status"] == "ok"
    assert [r["rank"] for r in config["per_rank"]] == [0, 1]
    merged, per = config["iterations"][0], [r["iterations"][0] for r in config["per_rank"]]
    assert merged["total_ms"] == max(p["total_ms"] for p in per)
    assert merged["response_tokens"] == sum(p["response_tokens"] for p in per)
    assert per[0]["loss"] == per[1]["loss"] == merged["loss"]  # the mean over both ranks' tokens, on each
    assert "backward_ms" in config["skew"]


@pytest.mark.slow
def test_the_deepspeed_launcher_runs_two_ranks_that_share_the_cores(tmp_path):
    """``deepspeed --num_accelerators 2 --module opsd_rollout bench ...``: the launcher passes ``--local_rank=N``
    before the subcommand and sets no thread count, so each rank takes its share of the cores, and the title
    and the JSON say so."""
    output = tmp_path / "run.json"
    env = {**clean_env(), "DS_ACCELERATOR": "cpu"}
    env.pop("OMP_NUM_THREADS", None)  # the launcher's default, as a user gets it
    bench = ARGS[:ARGS.index("--nproc")]  # the launcher starts the ranks
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_accelerators", "2", "--master_port",
               str(free_port()), "--module", "opsd_rollout", "bench", *bench, "--output", str(output)]
    result = run_named("bench on 2 ranks under DeepSpeed's launcher (about 16 s on 2 quiet cores)", command, env=env,
                       timeout=1500, cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    document = json.loads(output.read_text())
    jsonschema.validate(document, load_schema())
    environment = document["environment"]
    assert "--local_rank=0" in environment["command"], "the launcher's flag reached the command line"
    cores = os.cpu_count()
    threads = max(1, cores // 2)
    assert (environment["world_size"], environment["local_ranks"]) == (2, 2)
    assert (environment["threads"], environment["threads_source"]) == (threads, "shared")
    assert f"({threads} thread{'s' * (threads != 1)} per rank: {cores} cores / 2 local ranks)" in result.stdout
    for config in document["results"]:
        assert config["status"] == "ok" and [r["rank"] for r in config["per_rank"]] == [0, 1]
