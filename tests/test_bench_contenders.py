"""Contenders and knobs as benchmark axes (issue 28, parts 1-2): ``--strategies static,generate,deepspeed`` with
``--interleave`` and ``--baseline``, each config's Hodges-Lehmann ratio to its baseline's in the table and the JSON,
the workload's lengths forced alike on every contender, DeepSpeed's own OPSD step, and the knob axes
(continuous batch size, KV budget, compaction, shared prefix, stop-check interval) reaching the engine without
multiplying the configs of contenders they do not apply to. On llama-tiny, never timing assertions."""

from __future__ import annotations

import contextlib
import io
import json

import jsonschema
import pytest
import torch
from deepspeed.runtime.rollout import HybridEngineRollout as DeepSpeedsRollout

from opsd_rollout import HybridEngineRollout
from opsd_rollout.bench.configfile import read_config_file, split_config
from opsd_rollout.bench.contenders import knob_notes, set_baselines
from opsd_rollout.bench.matrix import Matrix
from opsd_rollout.bench.prompts import rollout_inputs
from opsd_rollout.bench.report import load_schema, results_of
from opsd_rollout.bench.engines import EnginePool
from opsd_rollout.bench.runner import BenchRunner
from opsd_rollout.bench.scenarios import RolloutConfig, RolloutScenario, RolloutSettings
from opsd_rollout.bench.contenders.deepspeed import real_response_tokens
from opsd_rollout.cli import main
from opsd_rollout.presets import PRESETS

SHAPE = ["--model", "llama-tiny", "--batch-sizes", "2", "--samples-per-prompt", "2", "--prompt-lengths", "8",
         "--response-lengths", "10", "--warmup", "0", "--zero-stages", "0"]
FORCED = "geometric:mean=3"
"""A synthetic length model: rows end well before the cap, each at a length its content decides."""


@pytest.fixture(scope="module")
def contenders_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("contenders") / "run.json"
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as env, contextlib.redirect_stdout(printed):
        env.setenv("COLUMNS", "80")  # COLUMNS alone is put back: the environment DeepSpeed set up stays
        code = main(["bench", *SHAPE, "--strategies", "static,generate,deepspeed", "--interleave", "--iterations", "4",
                     "--length-models", FORCED, "--output", str(out)])
    return code, json.loads(out.read_text()), printed.getvalue()


def test_interleaved_contenders_report_each_ratio_to_the_baseline(contenders_run):
    code, document, printed = contenders_run
    assert code == 0, printed
    jsonschema.validate(document, load_schema())
    assert document["settings"]["interleave"] is True
    results = {r["config"]["strategy"]: r for r in document["results"]}
    assert list(results) == ["static", "generate", "deepspeed"] and all(r["status"] == "ok" for r in results.values())
    static = results["static"]
    for strategy, result in results.items():
        baseline = result["baseline"]
        assert baseline["strategy"] == "static" and baseline["key"] == static["key"]
        for metric in ("total_ms", "tokens_per_second"):
            figures = baseline["metrics"][metric]
            if strategy == "static":
                assert figures == {"ratio": 1.0, "low": 1.0, "high": 1.0}
            else:
                assert 0 < figures["low"] <= figures["ratio"] <= figures["high"]
    # DeepSpeed's rollout has none of our rollout's knobs: they are n/a in its config and its key
    assert results["deepspeed"]["config"]["cache_policy"] is None and "retain" not in results["deepspeed"]["key"]
    assert results["deepspeed"]["iterations"][0]["strategy"] == "deepspeed"
    assert "against static (Hodges-Lehmann ratio" in printed and "interleaved round by round" in printed
    assert max(map(len, printed.splitlines())) <= 80 and "…" not in printed


def test_forced_lengths_give_every_contender_the_same_work(contenders_run):
    """Greedy rows with the same content get the same forced lengths in ours, DeepSpeed's rollout and generate."""
    _, document, _ = contenders_run
    tokens = {r["config"]["strategy"]: [it["generated_tokens"] for it in r["iterations"]] for r in document["results"]}
    assert tokens["static"] == tokens["generate"] == tokens["deepspeed"], tokens
    assert 4 <= tokens["static"][0] < 4 * 10  # forced: rows ended before the cap


def test_forced_lengths_reach_every_contender_row_by_row():
    matrix = Matrix.parse(RolloutScenario, {"strategies": ["static", "generate", "deepspeed"], "zero_stages": [0],
                                            "batch_sizes": [3], "samples_per_prompt": [2], "prompt_lengths": [8],
                                            "response_lengths": [16], "length_models": [FORCED]})
    settings = RolloutSettings(model="llama-tiny")
    pool = EnginePool("llama-tiny", torch.device("cpu"))
    try:
        lengths = {}
        for config in matrix.expand():
            rollout, built = pool.rollout(config)
            request, sampling = rollout_inputs(config, settings, built.tokenizer, built.spec.vocab_size, 0, pool.device)
            batch = rollout.generate(request, sampling)
            lengths[config.strategy] = real_response_tokens(batch.input_ids, 8, built.tokenizer.eos_token_id)
            assert rollout.get_last_profile()["generated_tokens"] == int(lengths[config.strategy].sum())
    finally:
        pool.close()
    assert torch.equal(lengths["static"], lengths["generate"]) and torch.equal(lengths["static"], lengths["deepspeed"])
    assert lengths["static"].min() < 16 and len(set(lengths["static"].tolist())) > 1  # forced, and row by row


def test_the_baseline_is_any_contender_and_its_ratios_are_reciprocal(contenders_run):
    _, document, _ = contenders_run
    results = results_of(document, RolloutConfig)
    axes = RolloutScenario.axes
    against_static = results[2].baseline["metrics"]["total_ms"]["ratio"]  # deepspeed / static
    set_baselines(results, axes, "deepspeed")
    assert results[2].baseline["metrics"]["total_ms"] == {"ratio": 1.0, "low": 1.0, "high": 1.0}
    assert results[0].baseline["metrics"]["total_ms"]["ratio"] == pytest.approx(1 / against_static)
    set_baselines(results[:1], axes, "static")  # one contender: nothing to set it against
    assert results[0].baseline is None


@pytest.mark.parametrize("interleave", [True, False])
def test_interleaved_rounds_alternate_the_contenders_order(monkeypatch, interleave):
    calls = []
    ours, theirs = HybridEngineRollout.generate, DeepSpeedsRollout.generate

    def our_generate(self, request, sampling, **kwargs):
        calls.append(self.cfg.strategy)
        return ours(self, request, sampling, **kwargs)

    def their_generate(self, request, sampling):
        calls.append("deepspeed")
        return theirs(self, request, sampling)

    monkeypatch.setattr(HybridEngineRollout, "generate", our_generate)
    monkeypatch.setattr(DeepSpeedsRollout, "generate", their_generate)
    matrix = Matrix.parse(RolloutScenario, {"strategies": ["static", "generate", "deepspeed"], "zero_stages": [0],
                                            "batch_sizes": [1], "samples_per_prompt": [1], "prompt_lengths": [4],
                                            "response_lengths": [2]})
    settings = RolloutSettings(model="llama-tiny", warmup=1, iterations=3, interleave=interleave)
    runner = BenchRunner(matrix, settings, output=None, measure_machine=False)
    assert [r.status for r in runner.run()] == ["ok"] * 3
    s, g, d = "static", "generate", "deepspeed"
    if interleave:  # each warmed up, then one iteration of each per round, the order reversed every other round
        assert calls == [s, g, d] + [s, g, d] + [d, g, s] + [s, g, d]
    else:
        assert calls == [s] * 4 + [g] * 4 + [d] * 4


def _expand(**axes) -> list:
    return Matrix.parse(RolloutScenario, {"batch_sizes": [1], "samples_per_prompt": [1], **axes}).expand()


def test_knobs_at_their_defaults_keep_the_keys_and_off_them_enter_the_key():
    assert [c.key for c in _expand()] == ["B1-n1-P128-R32-fp32-greedy-zero0-static-retain-fwdon"]
    configs = _expand(continuous_batch_sizes=["2"], kv_budgets=["64MiB"], compaction=["off"], shared_prefix=["off"],
                      stop_check_intervals=["4"])
    assert [c.key for c in configs] == [
        "B1-n1-P128-R32-fp32-greedy-zero0-static-retain-fwdon-cb2-kv64MiB-nocompact-noshared-stop4"]


def test_a_knob_that_does_not_apply_to_a_contender_does_not_multiply_its_configs(capsys):
    configs = _expand(strategies=["static", "generate", "deepspeed"], compaction=["on", "off"],
                      stop_check_intervals=["auto", "1"], cache_policies=["retain", "release"])
    counts = {s: sum(c.strategy == s for c in configs) for s in ("static", "generate", "deepspeed")}
    assert counts == {"static": 8, "generate": 2, "deepspeed": 1}
    generate = next(c for c in configs if c.strategy == "generate")
    assert generate.compact_rows is None and generate.stop_check_interval is None
    deepspeed = next(c for c in configs if c.strategy == "deepspeed")
    assert deepspeed.cache_policy is None and deepspeed.forward_timing is None and deepspeed.compile_decode is None
    matrix = Matrix.parse(RolloutScenario, {"strategies": ["static", "generate"], "stop_check_intervals": ["1"]})
    assert knob_notes(matrix) == ["stop_check_intervals does not apply to generate: measured once there (recorded "
                                  "as null)"]
    assert main(["bench", "--model", "llama-tiny", "--strategies", "static,generate,deepspeed", "--compaction",
                 "on,off", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "11 configs" not in out and "compaction does not apply to generate, deepspeed" in out


KNOBS = [
    ("continuous_batch_sizes", "2", lambda cfg, sampling: sampling.continuous_batch_size == 2),
    ("kv_budgets", "1MiB", lambda cfg, sampling: cfg.kv_budget_bytes == 2**20),
    ("compaction", "off", lambda cfg, sampling: cfg.compact_rows is False),
    ("shared_prefix", "off", lambda cfg, sampling: cfg.options.shared_prefix is False),
    ("stop_check_intervals", "4", lambda cfg, sampling: cfg.options.stop_check_interval == 4),
    ("weight_copies", "on", lambda cfg, sampling: cfg.options.cpu_transposed_weights is True),
]


@pytest.mark.parametrize("axis,value,reached", KNOBS, ids=[k[0] for k in KNOBS])
def test_each_knob_axis_changes_what_the_engine_gets(monkeypatch, axis, value, reached):
    seen = []
    original = HybridEngineRollout.generate

    def spy(self, request, sampling, **kwargs):
        seen.append((self.cfg, sampling))
        return original(self, request, sampling, **kwargs)

    monkeypatch.setattr(HybridEngineRollout, "generate", spy)
    matrix = Matrix.parse(RolloutScenario, {axis: [RolloutScenario.defaults[axis][0], value], "zero_stages": ["none"],
                                            "batch_sizes": [2], "samples_per_prompt": [2], "prompt_lengths": [8],
                                            "response_lengths": [6]})
    runner = BenchRunner(matrix, RolloutSettings(model="llama-tiny", warmup=0, iterations=1), output=None,
                         measure_machine=False)
    assert [r.status for r in runner.run()] == ["ok", "ok"], [r.error for r in runner.results.values()]
    (default_cfg, default_sampling), (cfg, sampling) = seen  # one call per config, in the user's order
    assert reached(cfg, sampling) and not reached(default_cfg, default_sampling)


def test_knob_axes_read_from_flags_and_config_files(tmp_path, capsys):
    path = tmp_path / "bench.toml"
    path.write_text('continuous-batch-sizes = ["none", 4]\nkv-budgets = ["64MiB", "none"]\ncompaction = ["on", "off"]\n'
                    'shared-prefix = "off"\nstop-check-intervals = ["auto", 2]\nstrategies = "static,deepspeed"\n'
                    'interleave = true\nbaseline = "deepspeed"\n')
    axes, settings = split_config(read_config_file(path), RolloutScenario)
    matrix = Matrix.parse(RolloutScenario, axes)
    assert matrix["continuous_batch_sizes"] == [None, 4] and matrix["kv_budgets"] == [64 * 2**20, None]
    assert matrix["compaction"] == [True, False] and matrix["shared_prefix"] == [False]
    assert matrix["stop_check_intervals"] == [None, 2] and matrix["strategies"] == ["static", "deepspeed"]
    assert RolloutSettings(**settings).interleave is True and settings["baseline"] == "deepspeed"
    assert Matrix.parse(RolloutScenario, matrix.to_dict()).values == matrix.values  # a result file's matrix reads back
    assert main(["bench", "--model", "llama-tiny", "--kv-budgets", "0,x", "--stop-check-intervals", "0",
                 "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "kv_budgets: '0' is not none or a size such as 64MiB" in err and "kv_budgets: 'x'" in err
    assert "stop_check_intervals: '0' is not auto or an integer >= 1" in err


@pytest.mark.parametrize("argv,message", [
    (["--strategies", "static,deepspeed", "--zero-stages", "none,0"], "drop none from --zero-stages"),
    (["--strategies", "static,generate", "--baseline", "deepspeed"], "--baseline deepspeed: not among --strategies"),
    (["--baseline", "vllm"], "baseline must be one of [None, 'static', 'generate', 'deepspeed']"),
])
def test_what_cannot_be_compared_is_refused_up_front(capsys, argv, message):
    assert main(["bench", "--model", "llama-tiny", "--dry-run", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_step_deepspeed_contender_runs_on_a_tiny_pair(tmp_path):
    out = tmp_path / "step.json"
    assert main(["step", "--student", "llama-tiny", "--teacher", "llama-tiny", "--strategies", "static,deepspeed",
                 "--zero-stages", "0", "--batch-sizes", "1", "--samples-per-prompt", "2", "--prompt-lengths", "8",
                 "--response-lengths", "4", "--warmup", "0", "--iterations", "2", "--losses", "jsd,sampled_reverse_kl",
                 "--output", str(out)]) == 0
    document = json.loads(out.read_text())
    jsonschema.validate(document, load_schema())
    results = {(r["config"]["strategy"], r["config"]["loss"]): r for r in document["results"]}
    ours, theirs = results[("static", "jsd")], results[("deepspeed", "jsd")]
    assert theirs["status"] == "ok", theirs["error"]
    for it in theirs["iterations"]:
        assert it["rollout/strategy"] == "deepspeed" and it["fused_loss"] is False
        assert it["tokens_per_second"] > 0 and it["peak_memory_bytes"] > 0 and it["backward_ms"] > 0
        vocab = PRESETS["llama-tiny"].vocab_size
        assert it["teacher_cache_bytes"] == 2 * (8 + 4 - 1) * vocab * 4  # the teacher's whole logits [N, T - 1, V]
    assert theirs["iterations"][0]["response_tokens"] == ours["iterations"][0]["response_tokens"] > 0  # greedy: alike
    assert theirs["baseline"]["key"] == ours["key"] and ours["baseline"]["metrics"]["total_ms"]["ratio"] == 1.0
    skipped = results[("deepspeed", "sampled_reverse_kl")]
    assert skipped["status"] == "skipped" and "no sampled-token loss" in skipped["error"]
    assert results[("static", "sampled_reverse_kl")]["status"] == "ok"
