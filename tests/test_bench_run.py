"""``opsd-rollout bench`` end to end on the tiny model: JSON against its schema, failures recorded, plots,
trace, dry run, an interrupted run resumed, and ``compare``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import jsonschema
import pytest

from conftest import HOLD_HOOK, clean_env, held, holding, hook_path
from opsd_rollout import HybridEngineRollout
from opsd_rollout.bench.matrix import Matrix
from opsd_rollout.bench.scenarios import RolloutScenario, RolloutSettings
from opsd_rollout.bench.report import load_schema
from opsd_rollout.bench.runner import BenchRunner
from opsd_rollout.cli import main

TINY = ["--model", "llama-tiny", "--prompt-lengths", "8", "--response-lengths", "4", "--warmup", "0",
        "--iterations", "6", "--zero-stages", "none"]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    code = main(["bench", *TINY, "--batch-sizes", "1,2", "--samples-per-prompt", "1,2", "--output",
                 str(out / "run.json"), "--plot", str(out / "plots"), "--trace", str(out / "trace.json")])
    return code, out


def test_bench_writes_a_schema_valid_document_in_user_order(bench_run, capsys):
    code, out = bench_run
    assert code == 0
    document = json.loads((out / "run.json").read_text())
    jsonschema.validate(document, load_schema())
    keys = [r["key"] for r in document["results"]]
    assert [r["config"]["batch_size"] for r in document["results"]] == [1, 1, 2, 2]
    assert document["run_order"][0] == keys[-1]  # B2 n2 is the largest: it ran first
    for result in document["results"]:
        assert result["status"] == "ok" and len(result["iterations"]) == 6
        summary = result["summary"]["total_ms"]
        assert summary["count"] == 6 and summary["min"] <= summary["p50"] <= summary["max"]
        assert result["derived"]["time_per_output_token_ms"] > 0
        assert 0 < result["derived"]["decode_bandwidth_utilisation"]
        assert all(it["response_length"] == 4 for it in result["iterations"])  # fixed length
    env = document["environment"]
    assert env["ceilings"]["memory_bandwidth_bytes_per_s"] > 0 and "matmul" in env["ceilings"]["method"]
    for result in document["results"]:  # the roofline: the bytes a step reads, over its time, over the copy's speed
        d, c = result["derived"], result["config"]
        assert d["decode_bytes_per_step"] > c["batch_size"] * c["samples_per_prompt"] * 4 * (16 + 2)  # weights + KV
        assert d["decode_bandwidth_bytes_per_s"] == pytest.approx(
            d["decode_bytes_per_step"] / (d["time_per_output_token_ms"] / 1e3))
        assert d["decode_bandwidth_utilisation"] == pytest.approx(
            d["decode_bandwidth_bytes_per_s"] / env["ceilings"]["memory_bandwidth_bytes_per_s"])
    from opsd_rollout.bench.report import ConfigResult
    from opsd_rollout.bench.tables import roofline_table

    results = [ConfigResult.from_dict(r, RolloutScenario.config_type) for r in document["results"]]
    table = roofline_table(results, [("", "decode_")])
    copy = env["ceilings"]["memory_bandwidth_bytes_per_s"] / 1e9
    assert f"{copy:.1f} GB/s" in str(table.title) and len(table.cells) == 4
    assert all(cells[3] != "-" for cells, _ in table.cells)  # every config's share of the roofline
    assert env["command"] and env["torch"] and env["deepspeed"]


def test_bench_writes_three_png_plots_and_a_nested_trace(bench_run):
    _, out = bench_run
    pngs = sorted((out / "plots").glob("*.png"))
    assert [p.name for p in pngs] == ["latency.png", "stages.png", "throughput.png"]
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    trace = json.loads((out / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in spans}
    assert {"rollout", "prompt_expansion", "generation", "prefill forward", "decode step 0",
            "post_processing", "attention_mask"} <= names
    processes = {e["pid"] for e in spans}
    assert len(processes) == 4
    for pid in processes:
        root = next(e for e in spans if e["pid"] == pid and e["name"] == "rollout")
        for event in (e for e in spans if e["pid"] == pid):
            assert root["ts"] <= event["ts"] and event["ts"] + event["dur"] <= root["ts"] + root["dur"] + 1


def test_a_failing_config_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    original = HybridEngineRollout.generate

    def flaky(self, request, sampling, **kwargs):
        if request.prompt_ids.shape[0] == 2:
            raise RuntimeError("CUDA out of memory (planted)")
        return original(self, request, sampling, **kwargs)

    monkeypatch.setattr(HybridEngineRollout, "generate", flaky)
    matrix = Matrix.parse(RolloutScenario, {"batch_sizes": [1, 2, 3], "prompt_lengths": [8], "response_lengths": [2],
                                "samples_per_prompt": [1], "zero_stages": ["none"]})
    runner = BenchRunner(matrix, RolloutSettings(model="llama-tiny", warmup=0, iterations=2),
                         output=tmp_path / "r.json", measure_machine=False)
    results = runner.run()
    assert [r.status for r in results] == ["ok", "failed", "ok"]
    assert "planted" in results[1].error
    document = json.loads((tmp_path / "r.json").read_text())
    jsonschema.validate(document, load_schema())
    assert document["results"][1]["status"] == "failed"


def test_dry_run_prints_the_matrix_and_its_order(capsys):
    assert main(["bench", *TINY, "--batch-sizes", "1,4", "--samples-per-prompt", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "2 configs" in out and "B1-n2-P8-R4" in out and "B4-n2-P8-R4" in out


@pytest.mark.parametrize("argv,message", [
    (["--batch-sizes", "0,x"], "batch_sizes: '0' is not an integer >= 1"),
    (["--dtypes", "fp8"], "dtypes: 'fp8' is not one of fp32, fp16, bf16"),
    (["--prompt-lengths", "1020", "--response-lengths", "8"], "beyond the model's 1024 positions"),
    (["--iterations", "0"], "iterations must be an int >= 1"),
    (["--model", "someone/model"], "never downloads"),
    (["--config", "missing.toml"], "cannot read it"),
    (["--resume-results", "missing.json"], "does not exist"),
])
def test_bad_bench_input_is_one_clear_message(capsys, argv, message):
    assert main(["bench", "--model", "llama-tiny", "--dry-run", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def quiet(document: dict) -> dict:
    """``document`` with every config recorded undisturbed: what compare decides must not depend on how busy
    this machine was while the fixture ran (a disturbed config is not judged)."""
    for result in document["results"]:
        result["interference"] = {**result["interference"], "reasons": [], "disturbed": False}
    return document


def test_compare_passes_identical_runs_and_flags_a_planted_regression(bench_run, tmp_path, capsys):
    """The run's real document, its times planted with a quiet machine's spread (1%) and its configs recorded
    undisturbed: what compare decides then depends on the planted slowdown alone."""
    _, out = bench_run
    document = quiet(json.loads((out / "run.json").read_text()))
    for result in document["results"]:
        for i, it in enumerate(result["iterations"]):
            it["total_ms"] = 100.0 + i % 3 * 0.5
            it["tokens_per_second"] = it["generated_tokens"] / it["total_ms"] * 1e3
    before = tmp_path / "quiet.json"
    before.write_text(json.dumps(document))
    assert main(["compare", str(before), str(before)]) == 0
    for result in document["results"]:
        for it in result["iterations"]:
            it["total_ms"] *= 1.5
            it["tokens_per_second"] /= 1.5
    slowed = tmp_path / "slowed.json"
    slowed.write_text(json.dumps(document))
    code = main(["compare", str(before), str(slowed), "--markdown", str(tmp_path / "cmp.md")])
    out_text = capsys.readouterr().out
    assert code == 1 and "REGRESSION" in out_text and "Hodges-Lehmann ratio" in out_text
    markdown = (tmp_path / "cmp.md").read_text()
    assert "| total ms |" in markdown and "+50.0%" in markdown and "| peak MiB |" in markdown


@pytest.mark.slow
def test_an_interrupted_run_leaves_valid_json_that_resume_completes(tmp_path):
    output = tmp_path / "run.json"
    command = [sys.executable, "-m", "opsd_rollout", "bench", "--model", "llama-tiny", "--zero-stages", "none",
               "--batch-sizes", "1,2,3", "--samples-per-prompt", "1", "--prompt-lengths", "8",
               "--response-lengths", "48", "--warmup", "0", "--iterations", "25", "--output", str(output)]
    env = {**clean_env(), "DS_ACCELERATOR": "cpu", "PYTHONPATH": hook_path(tmp_path, HOLD_HOOK),
           **holding(tmp_path, 2, at="opsd_rollout.bench.runner:BenchRunner._run_batch")}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        held(process, tmp_path)  # the first config measured and written, the second not begun
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait(timeout=600)
    document = json.loads(output.read_text())
    jsonschema.validate(document, load_schema())
    statuses = [r["status"] for r in document["results"]]
    assert "ok" in statuses and "pending" in statuses, statuses
    assert main(["bench", "--resume-results", str(output)]) == 0
    resumed = json.loads(output.read_text())
    assert [r["status"] for r in resumed["results"]] == ["ok", "ok", "ok"]
    finished_first = [r for r, s in zip(document["results"], statuses) if s == "ok"]
    for before in finished_first:  # what was done is kept, not rerun
        after = next(r for r in resumed["results"] if r["key"] == before["key"])
        assert after["iterations"] == before["iterations"]


@pytest.mark.slow
def test_step_benchmark_end_to_end(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["step", "--student", "llama-tiny", "--teacher", "qwen2-tiny", "--losses", "jsd,forward_kl",
                 "--betas", "0.5", "--teacher-caches", "full,top8", "--zero-stages", "0", "--batch-sizes", "1",
                 "--samples-per-prompt", "2", "--prompt-lengths", "8", "--response-lengths", "6", "--warmup", "0",
                 "--iterations", "2", "--output", str(out), "--plot", str(tmp_path / "plots"),
                 "--trace", str(tmp_path / "trace.json")]) == 0
    document = json.loads(out.read_text())
    jsonschema.validate(document, load_schema())
    assert document["kind"] == "step" and document["settings"]["teacher"] == "qwen2-tiny"
    assert [r["config"]["loss"] for r in document["results"]] == ["jsd", "jsd", "forward_kl", "forward_kl"]
    assert [r["config"]["beta"] for r in document["results"]] == [0.5, 0.5, None, None]
    for result in document["results"]:
        assert result["status"] == "ok", result["error"]
        it = result["iterations"][0]
        assert it["rollout/strategy"] == "static" and 0 < it["rollout_share"] < 1
        assert result["summary"]["backward_ms"]["count"] == 2
        assert 0 < result["derived"]["rollout_share"] < 1
    full, top8 = document["results"][0]["iterations"][0], document["results"][1]["iterations"][0]
    assert top8["teacher_cache_bytes"] < full["teacher_cache_bytes"]
    # one batch size: no throughput-against-batch plot
    assert sorted(p.name for p in (tmp_path / "plots").glob("*.png")) == ["latency.png", "stages.png"]
    names = {e["name"] for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]}
    assert {"step", "teacher", "backward", "optimizer", "prefill forward"} <= names
    assert "rollout share = (eval + rollout + train) / step" in capsys.readouterr().out


def test_step_refuses_a_bare_model_up_front(capsys):
    assert main(["step", "--zero-stages", "none", "--dry-run"]) == 2
    assert "trains a DeepSpeed engine" in capsys.readouterr().err


def test_compare_can_match_across_strategies(bench_run, tmp_path, capsys):
    _, out = bench_run
    document = quiet(json.loads((out / "run.json").read_text()))
    run = tmp_path / "run.json"
    run.write_text(json.dumps(document))
    document["matrix"]["strategies"] = ["generate"]
    for result in document["results"]:  # the same runs, relabelled as another strategy's
        result["config"]["strategy"] = "generate"
        result["key"] = result["key"].replace("-static-", "-generate-")
    other = tmp_path / "generate.json"
    other.write_text(json.dumps(document))
    assert main(["compare", str(run), str(other)]) == 3  # nothing in common: not a pass
    printed = capsys.readouterr().out
    assert "only in AFTER" in printed and "matrix: strategies ['static'] in BEFORE, ['generate'] in AFTER" in printed
    assert main(["compare", str(run), str(other), "--ignore-axes", "strategy"]) == 0
    printed = capsys.readouterr().out
    assert "only in" not in printed and "total ms" in printed and "4 config(s) compared" in printed
    assert main(["compare", str(run), str(other), "--ignore-axes", "colour"]) == 2
    assert main(["compare", str(run), str(other), "--ignore-axes", "strategy,batch_size"]) == 0
    assert "match the same config once" in capsys.readouterr().out


def _render(tables, width: int = 80) -> str:
    import io

    from rich.console import Console

    console = Console(width=width, file=io.StringIO(), record=True)
    for table in tables:
        console.print(table)
    return console.export_text()


def test_tables_fit_an_80_column_terminal_without_cutting_a_number(bench_run):
    from opsd_rollout.bench.report import results_of
    from opsd_rollout.bench.scenarios import RolloutConfig, StepConfig, StepScenario, StepSettings

    _, out = bench_run
    document = json.loads((out / "run.json").read_text())
    text = _render(RolloutScenario(RolloutSettings()).tables(results_of(document, RolloutConfig)))
    assert "…" not in text and max(map(len, text.splitlines())) <= 80
    step_iteration = {"total_ms": 1234.5, "rollout_share": 0.36, "loss": 0.1234, "peak_memory_bytes": 3 * 2**30,
                      "teacher_cache_bytes": 12.5 * 2**20, "rollout_ms": 456.7, "teacher_forward_ms": 321.0,
                      "cache_write_ms": 1.25, "student_forward_ms": 12.5, "loss_ms": 10.75, "backward_ms": 123.4,
                      "optimizer_ms": 20.5}
    step = results_of({"results": [{"key": "k", "status": "ok", "iterations": [step_iteration] * 3, "config": {
        **result["config"], "zero_stage": zero, "loss": "jsd", "beta": 0.5, "teacher_cache": "top64"}}
        for result in document["results"] for zero in (0, 3)]}, StepConfig)
    text = _render(StepScenario(StepSettings()).tables(step))
    assert "…" not in text and max(map(len, text.splitlines())) <= 80
    assert "loss" in text and "time" in text and "1,234.5" in text and "0.1234" in text
