"""Matrix expansion, run order, validation messages, config files, and the statistics type."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opsd_rollout.bench.configfile import read_config_file, split_config
from opsd_rollout.bench.matrix import Matrix, run_order
from opsd_rollout.bench.scenarios import RolloutScenario, RolloutSettings, StepScenario, StepSettings
from opsd_rollout.bench.stats import Stats, median, median_index

small_ints = st.lists(st.integers(1, 64), min_size=1, max_size=3, unique=True)


@settings(max_examples=60, deadline=None)
@given(b=small_ints, n=small_ints, p=small_ints, r=small_ints,
       dtypes=st.lists(st.sampled_from(["fp32", "bf16"]), min_size=1, max_size=2, unique=True),
       zero=st.lists(st.sampled_from(["none", 0, 3]), min_size=1, max_size=2, unique=True))
def test_expansion_is_the_product_and_run_order_is_largest_first_per_engine(b, n, p, r, dtypes, zero):
    matrix = Matrix.parse(RolloutScenario, {"batch_sizes": b, "samples_per_prompt": n, "prompt_lengths": p,
                                "response_lengths": r, "dtypes": dtypes, "zero_stages": zero})
    configs = matrix.expand()
    assert len(configs) == len(b) * len(n) * len(p) * len(r) * len(dtypes) * len(zero)
    assert len({c.key for c in configs}) == len(configs)
    assert [c.batch_size for c in configs[::len(configs) // len(b)]] == b  # user order: first axis slowest
    order = run_order(configs)
    assert sorted(c.key for c in order) == sorted(c.key for c in configs)
    engines = list(dict.fromkeys(c.engine_key for c in configs))
    groups = [c.engine_key for c in order]
    assert groups == sorted(groups, key=engines.index), "each engine's configs run together, in user order"
    for engine in engines:
        sizes = [(c.effective_batch_size, c.prompt_length + c.response_length) for c in order if c.engine_key == engine]
        assert sizes == sorted(sizes, reverse=True), "largest effective batch, then longest sequence, first"


def test_every_bad_value_is_listed_in_one_message():
    with pytest.raises(ValueError) as error:
        Matrix.parse(RolloutScenario, {"batch_sizes": ["1", "0", "x"], "dtypes": ["fp32", "fp8"], "zero_stages": ["4"],
                           "decoding": ["beam"], "colours": ["red"]})
    message = str(error.value)
    for fragment in ("batch_sizes: '0' is not an integer >= 1", "batch_sizes: 'x'", "dtypes: 'fp8'",
                     "zero_stages: '4'", "decoding: 'beam'", "unknown axis 'colours'"):
        assert fragment in message


def test_positions_beyond_the_model_are_refused_up_front():
    matrix = Matrix.parse(RolloutScenario, {"prompt_lengths": [512, 1000], "response_lengths": [32, 64]})
    with pytest.raises(ValueError, match="prompt 1000 \\+ response 32 = 1032; prompt 1000 \\+ response 64"):
        matrix.check_positions(1024)
    matrix.check_positions(2048)


def test_settings_are_validated_together():
    with pytest.raises(ValueError) as error:
        RolloutSettings(iterations=0, warmup=-1, top_p=2.0, prompts="random")
    for fragment in ("iterations must be", "warmup must be", "top_p must be", "prompts must be"):
        assert fragment in str(error.value)


@pytest.mark.parametrize("suffix,text", [
    (".toml", 'batch_sizes = [2, 8]\nsamples-per-prompt = [4]\niterations = 3\nmodel = "gpt2-tiny"\n'),
    (".json", json.dumps({"batch_sizes": [2, 8], "samples_per_prompt": 4, "iterations": 3, "model": "gpt2-tiny"})),
    (".yaml", "batch_sizes: [2, 8]\nsamples_per_prompt: '4'\niterations: 3\nmodel: gpt2-tiny\n"),
])
def test_config_files_in_three_formats(tmp_path, suffix, text):
    path = tmp_path / f"bench{suffix}"
    path.write_text(text)
    axes, settings_ = split_config(read_config_file(path), RolloutScenario)
    matrix = Matrix.parse(RolloutScenario, axes)
    assert matrix["batch_sizes"] == [2, 8] and matrix["samples_per_prompt"] == [4]
    assert RolloutSettings(**settings_).iterations == 3


def test_config_file_unknown_key_is_named(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"batch_size": [1]}')
    with pytest.raises(ValueError, match="unknown keys \\['batch_size'\\]"):
        split_config(read_config_file(path), RolloutScenario)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.001, 1e6, allow_nan=False), min_size=1, max_size=40))
def test_stats_match_numpy(values):
    s = Stats.from_values(values)
    array = np.asarray(values)
    assert s.count == len(values)
    assert s.mean == pytest.approx(array.mean())
    assert s.p50 == pytest.approx(np.median(array))
    assert s.p95 == pytest.approx(np.percentile(array, 95))
    assert (s.min, s.max) == (array.min(), array.max())
    assert s.stdev == pytest.approx(array.std(ddof=1) if len(values) > 1 else 0.0)
    assert s.iqr == pytest.approx(np.percentile(array, 75) - np.percentile(array, 25))


def test_stats_skip_missing_and_flag_spread_and_one_median():
    pooled = Stats.from_values([1.0, 2.0, 3.0, None, float("nan")])
    assert pooled.count == 3 and pooled.p50 == 2.0 == median([3.0, 1.0, 2.0])
    assert Stats.from_values([1.0, 2.0, 3.0, 10.0]).p50 == 2.5 == median([1, 2, 3, 10])
    assert [median_index(v) for v in ([5.0, 1.0, 3.0], [4.0, 1.0, 3.0, 2.0], [7.0])] == [2, 3, 0]
    assert Stats.from_values([None]) is None
    assert Stats.from_values([100, 100, 100, 100]).noisy is False
    assert Stats.from_values([80, 100, 120, 140]).noisy is True


def test_each_kind_owns_its_axes_and_defaults():
    """A library caller gets a working step benchmark from the defaults alone (the step's settings, teacher
    included, live with the step scenario), and rollout configs carry no step axes."""
    from opsd_rollout.models import max_positions

    settings_ = StepSettings()
    assert (settings_.model, settings_.teacher, settings_.lr) == ("llama-tiny", "llama-small", 1e-3)
    matrix = Matrix.parse(StepScenario, {"losses": ["forward_kl", "jsd"], "betas": ["0.2", "0.7"]})
    StepScenario(settings_).check(matrix, max_positions)
    configs = matrix.expand()
    assert sorted((c.loss, c.beta) for c in configs if c.zero_stage == 0) == [
        ("forward_kl", None), ("jsd", 0.2), ("jsd", 0.7)]  # beta varies the JSD only
    assert configs[0].key.endswith("-forward_kl-full") and "jsd0.2-full" in configs[1].key
    rollout = Matrix.defaults(RolloutScenario).expand()[0]
    assert not hasattr(rollout, "loss") and set(Matrix.defaults(RolloutScenario).to_dict()) == {
        axis.name for axis in RolloutScenario.axes}
    with pytest.raises(ValueError, match="not none"):
        StepScenario(settings_).check(Matrix.parse(StepScenario, {"zero_stages": ["none"]}), max_positions)


@pytest.mark.slow  # a fresh interpreter
def test_the_command_line_describes_itself_without_importing_torch():
    """``--help`` reads only light modules (scenarios, axes, settings, presets): no torch, DeepSpeed or
    transformers until a command runs."""
    import sys

    from conftest import run_named

    code = ("import sys, opsd_rollout.cli as cli; cli.build_parser(); "
            "print(sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))")
    result = run_named("importing the CLI's parser (about 1 s on 2 quiet cores)", [sys.executable, "-c", code],
                       timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


@pytest.mark.parametrize("suffix,text,expected", [
    (".toml", "batch_sizes = [1,\nmodel = 'x'\n", r"bad.toml:2:1: "),
    (".json", '{"batch_sizes": [1,]}', r"bad.json:1:20: Expecting value"),
    (".yaml", "batch_sizes: [1, 2\nmodel: x\n", r"bad.yaml:2:"),
    (".yaml", "- just\n- a list\n", r"bad.yaml: must hold a table"),
])
def test_config_file_errors_are_one_line_naming_the_file_and_the_line(tmp_path, suffix, text, expected):
    path = tmp_path / f"bad{suffix}"
    path.write_text(text)
    with pytest.raises(ValueError) as error:
        read_config_file(path)
    message = str(error.value)
    assert "\n" not in message and expected in message and str(path) in message


def test_the_example_config_in_the_repository_loads():
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "bench.toml"
    axes, settings_ = split_config(read_config_file(example), RolloutScenario)
    matrix = Matrix.parse(RolloutScenario, axes)
    assert matrix.expand() and RolloutSettings(**settings_).iterations >= 1


def test_length_models_are_an_axis_whose_values_keep_their_own_commas():
    from opsd_rollout.bench.axes import split_specs

    assert split_specs("fixed,lognormal:median=48,sigma=1.0,natural,geometric:mean=8") == [
        "fixed", "lognormal:median=48,sigma=1.0", "natural", "geometric:mean=8"]
    matrix = Matrix.parse(RolloutScenario, {"batch_sizes": [1], "samples_per_prompt": [1],
                                            "length_models": split_specs("fixed,lognormal:median=48,sigma=1.0")})
    fixed, lognormal = matrix.expand()
    assert fixed.lengths == "fixed" and fixed.key.endswith("fwdon")  # fixed-length keys are as before
    assert lognormal.lengths == "lognormal:median=48,sigma=1" and lognormal.key.endswith("-lenlognormal:median=48,sigma=1")
    with pytest.raises(ValueError, match="length_models: 'uniform' is not fixed, natural"):
        Matrix.parse(RolloutScenario, {"length_models": ["uniform"]})


def test_the_sampled_loss_pairs_with_the_sampled_cache_alone():
    """``sampled_reverse_kl`` reads the sampled cache whatever the cache axis says; the other losses never get it."""
    matrix = Matrix.parse(StepScenario, {"losses": ["jsd", "sampled_reverse_kl"], "teacher_caches": ["full", "sampled"],
                                         "zero_stages": [0]})
    pairs = [(c.loss, c.teacher_cache) for c in matrix.expand()]
    assert pairs == [("jsd", "full"), ("sampled_reverse_kl", "sampled")]


def test_a_step_matrix_measures_our_rollout_profiled_and_not():
    """``--rollout-profiling on,off``: our contender once each way (a key of its own only when off, so results written
    before the axis keep theirs), its engine built accordingly; DeepSpeed's rollout, which profiles itself, once."""
    matrix = Matrix.parse(StepScenario, {"rollout_profiling": ["on", "off"], "strategies": ["static", "deepspeed"],
                                         "zero_stages": [0]})
    configs = matrix.expand()
    assert [(c.strategy, c.rollout_profiling) for c in configs] == [("static", True), ("static", False),
                                                                    ("deepspeed", None)]
    on, off, theirs = configs
    assert off.key == on.key + "-unprofiled" and on.key.endswith("-jsd0.5-full") and "unprofiled" in off.label
    assert (on.engine_fields["enable_profiling"], off.engine_fields["enable_profiling"]) == (True, False)
    assert "enable_profiling" not in theirs.engine_fields


def test_the_perf_workload_files_are_the_seeded_shapes_and_suites_of_make_perf():
    """``benchmarks/perf/*.toml``: issue 51's workloads sized for ``make perf`` (two of its three prompts, the long
    tail capped at 96), and ``benchmarks/rollout-lead/workloads/``: the same at full size, which its measurement
    reads; all fixed by the seed (greedy tokens from seeded prompts), and each perf file a suite of
    ``scripts/perf.py`` (compared with the baseline of its name)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]

    def configs_of(folder: Path) -> dict:
        configs = {}
        for path in folder.glob("*.toml"):
            axes, settings_ = split_config(read_config_file(path), RolloutScenario)
            configs[path.stem] = Matrix.parse(RolloutScenario, axes).expand()
            assert RolloutSettings(**settings_).seed == 0 and all(c.decoding == "greedy" for c in configs[path.stem])
        return configs

    def shapes(configs: list) -> set:
        return {(c.batch_size, c.samples_per_prompt, c.prompt_length, c.response_length, c.lengths,
                 c.continuous_batch_size) for c in configs}

    perf_files = configs_of(root / "benchmarks" / "perf")
    full = configs_of(root / "benchmarks" / "rollout-lead" / "workloads")
    assert set(full) == {"shared-prefix", "long-tail"} <= set(perf_files)
    tail = "lognormal:median=27,sigma=1.5"
    assert shapes(full["shared-prefix"]) == {(2, 8, p, 32, "fixed", None) for p in (128, 512, 1536)}
    assert shapes(perf_files["shared-prefix"]) == {(2, 8, p, 32, "fixed", None) for p in (128, 1536)}
    assert shapes(full["long-tail"]) == {(3, 8, 128, 384, tail, cbs) for cbs in (None, 8)}
    assert shapes(perf_files["long-tail"]) == {(3, 8, 128, 96, tail, cbs) for cbs in (None, 8)}
    spec = importlib.util.spec_from_file_location("perf_script", root / "scripts" / "perf.py")
    perf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(perf)
    for name in perf_files:
        path = root / "benchmarks" / "perf" / f"{name}.toml"
        assert perf.SUITES[name] == ("bench", ["--config", str(path)])
