"""The developers' kernel benchmarks (``scripts/bench_kernels.py``, out of the installed package): every kernel runs on
tiny shapes into a schema-valid document whose figures hold together (the speed-up is the round's ratio, the sides
produced the same output where they can), axes a kernel does not read add no configs, bad kernels and axes are
refused by name before any work, ``opsd-rollout compare`` reads a kernels document from the document alone and
flags a planted 1.5x slowdown of one kernel, and the command line's help and dry run (light: no torch)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from conftest import run_named
from kernel_bench import KERNELS
from kernel_bench.cli import main as kernels
from kernel_bench.scenario import KernelConfig, KernelSettings, KernelsScenario
from opsd_rollout.bench.compare import EXIT_REGRESSION, compare_documents
from opsd_rollout.bench.matrix import Matrix
from opsd_rollout.bench.report import ConfigResult, load_schema
from opsd_rollout.cli import main

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_kernels.py"

TINY = {"kernels": list(KERNELS), "rows": [4], "samples_per_prompt": [2], "prompt_lengths": [16],
        "response_lengths": [4], "vocab_sizes": [300], "top_ks": [20], "top_ps": [0.9]}
"""Every kernel at shapes that take milliseconds on the tiny model."""
QUIET = {"host": "planted", "load_average": [0.1, 0.1], "cpu_count": 2, "wall_seconds": 0.2,
         "process_cpu_seconds": 0.4, "machine_busy_seconds": 0.41, "machine_seconds": 0.4, "steal_seconds": 0.0,
         "gpu_other_processes": None, "other_busy_cores": 0.05, "steal_fraction": 0.0, "reasons": [],
         "disturbed": False}


@pytest.fixture(scope="module")
def document(tmp_path_factory):
    """One run of every kernel (the compiled step on dynamo's ``aot_eager`` backend: the same tracing and guards
    as inductor, without minutes of C++ kernels)."""
    from opsd_rollout.bench.runner import BenchRunner
    from opsd_rollout.rollout import compiled

    output = tmp_path_factory.mktemp("kernels") / "kernels.json"
    settings = KernelSettings(model="llama-tiny", warmup=1, iterations=3)
    runner = BenchRunner(Matrix.parse(KernelsScenario, TINY), settings, output=output)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled, "default_options", lambda device: {"backend": "aot_eager"})
        runner.run()
    return json.loads(output.read_text()), runner


def by_kernel(document: dict) -> dict[str, dict]:
    return {r["config"]["kernel"]: r for r in document["results"]}


def test_every_kernel_runs_into_a_schema_valid_document(document):
    doc, _ = document
    jsonschema.validate(doc, load_schema())
    assert doc["kind"] == "kernels" and [r["config"]["kernel"] for r in doc["results"]] == list(KERNELS)
    for result in doc["results"]:
        assert result["status"] == "ok", (result["key"], result["error"])
        assert len(result["iterations"]) == 3 and result["summary"]["kernel_ms"]["count"] == 3
        for it in result["iterations"]:
            assert it["total_ms"] > 0
            if result["config"]["kernel"] != "compile":  # a difference of two calls: a busy machine can flip its sign
                assert it["baseline_ms"] > 0 and it["speedup"] == pytest.approx(it["baseline_ms"] / it["kernel_ms"])


def test_each_side_reports_what_its_kernel_measures(document):
    results = by_kernel(document[0])
    # the sides agree where they can: same tokens, same loss, same products; two random draws cannot
    assert all(results[k]["derived"]["outputs_equal"] for k in KERNELS if k != "sampling")
    assert results["sampling"]["derived"]["outputs_equal"] is None
    assert all("greedy_ms" in it for it in results["sampling"]["iterations"])
    attention = results["attention"]["iterations"][0]
    assert 0 < attention["kv_workspace_bytes"] < attention["baseline_kv_workspace_bytes"]  # prompts stored once
    assert attention["kernel_ms"] < attention["call_ms"]  # a decode token, not the whole call
    post = results["postprocess"]["iterations"][0]
    assert post["kernel_ms"] < post["call_ms"] and post["baseline_ms"] < post["baseline_call_ms"]
    assert all(it["peak_memory_bytes"] > 0 for it in results["fused_loss"]["iterations"])
    compiled = results["compile"]["derived"]
    if compiled["kernel_ms"] > 0 and compiled["baseline_ms"] > 0:  # see above: a busy machine can flip a sign
        shares = compiled["baseline_bandwidth_utilisation"] / compiled["kernel_bandwidth_utilisation"]
        assert shares == pytest.approx(compiled["kernel_ms"] / compiled["baseline_ms"])  # same bytes, other times


def test_a_round_times_both_sides_in_alternating_order(document):
    """The trace's spans are the last round's sides inside it, one after the other."""
    _, runner = document
    spans = runner.timelines[by_kernel(document[0])["sampling"]["key"]]
    assert spans[0].name == "round" and {s.name for s in spans[1:]} == {"ours", "baseline", "greedy"}
    sides = sorted(spans[1:], key=lambda s: s.start_ms)
    assert all(a.start_ms + a.duration_ms == pytest.approx(b.start_ms) for a, b in zip(sides, sides[1:]))
    assert sides[-1].start_ms + sides[-1].duration_ms == pytest.approx(spans[0].duration_ms)


def test_axes_a_kernel_does_not_read_add_no_configs():
    matrix = Matrix.parse(KernelsScenario, {"kernels": ["sampling", "profiling"], "vocab_sizes": [256, 512],
                                            "dtypes": ["fp32", "bf16"], "weight_shapes": ["model", "64x32"]})
    keys = [c.key for c in matrix.expand()]
    assert len(keys) == 4 + 2  # sampling: 2 vocabularies x 2 dtypes; profiling: 2 dtypes
    profiling = [c for c in matrix.expand() if c.kernel == "profiling"][0]
    assert profiling.vocab_size is None and profiling.weight_shape is None and profiling.samples_per_prompt == 4
    postprocess = KernelsScenario.make_config(kernel="postprocess", dtype="bf16", rows=8, vocab_size=9,
                                              samples_per_prompt=2, prompt_length=4, response_length=2, top_k=5,
                                              top_p=1.0, teacher_cache="full", weight_shape="model")
    assert postprocess.dtype == "fp32" and postprocess.key == "postprocess-rows8-n2-P4-R2"  # it reads no dtype


def test_post_processing_is_measured_at_either_width_on_the_same_tokens():
    """``--response-widths longest`` trims our batch (its key says so; the default's key is unchanged), and its
    tokens are DeepSpeed's first columns, DeepSpeed's others all padding."""
    from types import SimpleNamespace

    import torch

    from kernel_bench.postprocess import PostprocessContest

    for width, key in (("max_new_tokens", "postprocess-rows8-n2-P6-R12"),
                       ("longest", "postprocess-rows8-n2-P6-R12-longest")):
        config = KernelsScenario.make_config(kernel="postprocess", rows=8, samples_per_prompt=2, prompt_length=6,
                                             response_length=12, response_width=width)
        assert config.key == key
        contest = PostprocessContest(config, SimpleNamespace(seed=1), torch.device("cpu"))
        ours, theirs = contest.ours(), contest.baseline()
        assert contest.same(ours, theirs)
        assert ours[1].shape[1] == 6 + (int(ours[1][:, 6:].ne(0).sum(1).max()) if width == "longest" else 12)


@pytest.mark.parametrize("width", ["max_new_tokens", "longest"])
def test_post_processing_after_our_decode_loop_takes_its_lengths(width):
    """``--postprocess-strategies static``: our side follows a stand-in for the decode loop, which hands over each
    row's length (the key says so; the default, ``generate``, adds nothing to it); the batch is DeepSpeed's."""
    from types import SimpleNamespace

    import torch

    from kernel_bench.postprocess import PostprocessContest
    from opsd_rollout.rollout import postprocess

    config = KernelsScenario.make_config(kernel="postprocess", rows=8, samples_per_prompt=2, prompt_length=6,
                                         response_length=12, postprocess_strategy="static", response_width=width)
    assert config.key == "postprocess-rows8-n2-P6-R12-static" + ("-longest" if width == "longest" else "")
    contest = PostprocessContest(config, SimpleNamespace(seed=1), torch.device("cpu"))
    ours, theirs = contest.ours(), contest.baseline()
    assert contest.same(ours, theirs)
    handed = contest.mine.strategy.last_stats.lengths
    assert torch.equal(handed, postprocess.response_lengths(ours[1][:, 6:], torch.tensor([2])))
    assert 0 < int((handed < 12).sum()) < 8  # some rows end early, some run to the end


@pytest.mark.parametrize("flags,named", [
    (["--kernels", "sampling,nonsense"], "kernels: 'nonsense' is not one of sampling"),
    (["--rows", "0"], "rows: '0' is not an integer >= 1"),
    (["--top-ps", "1.5"], "top_ps: '1.5' is not a number in (0, 1]"),
    (["--weight-shapes", "64x"], "weight_shapes: '64x' is not model or KxN"),
    (["--teacher-caches", "top0"], "teacher_caches: 'top0' is not full or top<k>"),
    (["--kernels", "attention", "--samples-per-prompt", "1"], "attention: samples_per_prompt must be >= 2"),
    (["--kernels", "profiling", "--rows", "6", "--samples-per-prompt", "4"], "rows 6 are not a whole number"),
    (["--kernels", "fused_loss", "--teacher-caches", "sampled"], "fused_loss: teacher_caches takes full or top<k>"),
    (["--kernels", "attention", "--prompt-lengths", "100000"], "beyond the model's"),
    (["--kernels", "sampling", "--model", "no-such-model"], "no-such-model"),
    (["--repeats", "0"], "repeats must be an int >= 1"),
])
def test_bad_kernels_and_axes_are_refused_by_name_before_any_work(flags, named, monkeypatch, capsys):
    import opsd_rollout.bench.session as session

    monkeypatch.setattr(session, "run_bench_session", lambda *a, **k: pytest.fail("a refused matrix ran"))
    assert kernels(["--model", "llama-tiny", *flags]) == 2
    assert named in capsys.readouterr().err


def test_kernels_help_lists_every_kernel_and_its_axes(capsys):
    with pytest.raises(SystemExit) as exit_:
        kernels(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert all(name in out for name in KERNELS)
    assert all(flag in out for flag in ("--kernels", "--vocab-sizes", "--rows", "--weight-shapes", "--hidden-size"))


def test_the_dry_run_lists_the_configs_and_runs_nothing(monkeypatch, capsys, tmp_path):
    import opsd_rollout.bench.session as session

    monkeypatch.setattr(session, "run_bench_session", lambda *a, **k: pytest.fail("the dry run ran"))
    monkeypatch.setenv("COLUMNS", "120")
    assert kernels(["--model", "llama-tiny", "--kernels", "sampling,weight_layout", "--vocab-sizes", "256,512",
                    "--dry-run", "--output", str(tmp_path / "none.json")]) == 0
    out = capsys.readouterr().out
    assert "3 configs on llama-tiny" in out
    assert "sampling-fp32-rows16-V256-topk50-topp0.95" in out and "weight_layout-fp32-rows16-Wmodel" in out
    assert not (tmp_path / "none.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["--help"], ["--model", "llama-tiny", "--dry-run"], ["--rows", "0"]], ids=" ".join)
def test_light_kernels_commands_import_no_torch(argv):
    """As ``opsd-rollout``'s light commands (``tests/test_cli_fast.py``): help, a dry run and bad input answer
    without importing torch, transformers or DeepSpeed."""
    child = ("import os, runpy, sys; sys.argv = sys.argv[1:]; sys.path.insert(0, os.path.dirname(sys.argv[0]))\n"
             "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
             "except SystemExit:\n    pass\nsys.stderr.write('\\nMODULES ' + ' '.join(sorted(sys.modules)) + '\\n')")
    result = run_named(f"scripts/bench_kernels.py {' '.join(argv)} in a fresh interpreter",
                       [sys.executable, "-c", child, str(SCRIPT), *argv], timeout=120)
    modules = result.stderr.rsplit("MODULES ", 1)[-1].split()
    assert "kernel_bench.cli" in modules, result.stderr[-2000:]
    heavy = [m for m in modules if m.split(".")[0] in ("deepspeed", "torch", "transformers")]
    assert not heavy, f"`scripts/bench_kernels.py {' '.join(argv)}` imported {heavy[:8]}"


# ---- compare on a kernels document ---------------------------------------------------------------------------

def plant(document: dict, *, seed: int, slower: str = "", iterations: int = 6) -> dict:
    """``document`` with planted rounds: ours 20 ms, the baseline 40 ms, each round scaled by one lognormal factor
    (sigma 3%); the kernel ``slower`` has ours 1.5x slower. Every config quiet."""
    document = copy.deepcopy(document)
    rng = np.random.default_rng(seed)
    document["settings"]["iterations"] = iterations
    for result in document["results"]:
        scale = 1.5 if result["config"]["kernel"] == slower else 1.0
        result["iterations"] = []
        for factor in rng.lognormal(0.0, 0.03, iterations):
            ours, baseline = 20.0 * factor * scale, 40.0 * factor
            result["iterations"].append({"total_ms": ours + baseline, "kernel_ms": ours, "baseline_ms": baseline,
                                         "speedup": baseline / ours})
        result["summary"] = {name: stats.to_dict() for name, stats in
                             ConfigResult.from_dict(result, KernelConfig).summary().items()}
        result["interference"] = dict(QUIET)
    return document


def test_compare_flags_a_planted_slowdown_of_one_kernel_only(document, tmp_path, capsys):
    doc, _ = document
    before, same, slowed = plant(doc, seed=1), plant(doc, seed=2), plant(doc, seed=2, slower="fused_loss")
    jsonschema.validate(slowed, load_schema())
    assert compare_documents(before, same).exit_status() == 0
    comparison = compare_documents(before, slowed)
    assert comparison.matched == len(KERNELS)
    flagged = {(c.key.split("-")[0], c.metric) for c in comparison.regressions}
    # both sides' total, 1.17x, is within what one process a side can claim (compare widens its interval by 20%)
    assert flagged == {("fused_loss", "kernel_ms"), ("fused_loss", "speedup")}
    paths = []
    for name, planted in (("before", before), ("after", slowed)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(planted))
    assert main(["compare", *map(str, paths)]) == EXIT_REGRESSION
    assert "REGRESSION" in capsys.readouterr().out
