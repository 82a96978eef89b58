"""DeepSpeed's public rollout surface, ours beside DeepSpeed's own ``HybridEngineRollout`` on real tiny models: the
config's six fields, the rollout's attributes, the batch's width and tokens, the profile's keys in both modes,
``get_last_continuous_stats()`` and ``build_rollout``'s keywords. Each behaviour runs through both rollouts where
DeepSpeed's runs on this machine; where it does not (its continuous batching on transformers 5.24), the test says
so and checks ours against DeepSpeed's source."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import warnings
from types import SimpleNamespace

import deepspeed.runtime.rollout as deepspeed_rollout
import pytest
import torch
from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRollout as DeepSpeedRollout
from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig as DeepSpeedConfig

import opsd_rollout
from conftest import chain_table, left_padded, make_tokenizer, transition_model
from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutConfig, SamplingConfig
from opsd_rollout.deepspeed_engine import build_engine

PAD, EOS = 0, 2
VALUES = {"use_graph_capture": (False, True), "enable_profiling": (False, True), "use_shared_prefill": (False, True),
          "align_decode_fronts": (False, True), "enable_cache_trimming": (False, True),
          "continuous_cache_capacity": (None, 64)}
"""Every field of DeepSpeed's config, with each value the parity is checked at."""


def dict_keys_in_source(function, name: str) -> set[str]:
    """The string keys a DeepSpeed function writes into the dict ``name`` (``self._last_profile`` or ``stats``): its
    literal's keys, ``name["key"] = ...`` and ``name.setdefault("key", ...)``, read from the installed source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    keys: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and \
                ast.unparse(node.targets[0]) == name:
            keys.update(k.value for k in node.value.keys if isinstance(k, ast.Constant))
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == name and \
                isinstance(node.ctx, ast.Store) and isinstance(node.slice, ast.Constant):
            keys.add(node.slice.value)
        if isinstance(node, ast.Call) and ast.unparse(node.func) == f"{name}.setdefault":
            keys.add(node.args[0].value)
    return keys


PLAIN_KEYS = dict_keys_in_source(DeepSpeedRollout.generate, "self._last_profile")
CONTINUOUS_KEYS = dict_keys_in_source(DeepSpeedRollout._finish_continuous_profile, "self._last_profile")
STATS_KEYS = dict_keys_in_source(DeepSpeedRollout._generate_continuous, "stats")


def test_the_keys_read_from_deepspeeds_source_are_its_documented_ones():
    """The source reading finds what DeepSpeed 0.19.8 writes (so a change in DeepSpeed shows up here)."""
    assert len(PLAIN_KEYS) == 14 and {"prefill_forward_ms", "num_generated_tokens"} <= PLAIN_KEYS
    assert CONTINUOUS_KEYS - PLAIN_KEYS == {"num_prefill_forwards", "scheduler_overhead_ms",
                                            "cache_management_overhead_ms", "active_batch_size",
                                            "continuous_batch_size"}
    assert STATS_KEYS == {"cache_capacity", "peak_cache_length", "cache_memory_bytes", "trim_count", "trimmed_columns",
                          "trim_latency_ms", "decode_steps", "end_to_end_ms", "tokens_per_second", "trim_bytes_moved",
                          "trim_frequency"}


@pytest.fixture()
def chain():
    """A real one-layer Llama whose greedy next token follows a table: rows stop at EOS at different steps."""
    return transition_model(chain_table(16, {7: EOS, 12: EOS})), make_tokenizer(PAD, EOS)


def both(engine, tokenizer, cfg):
    return DeepSpeedRollout(SimpleNamespace(module=engine), tokenizer, cfg=cfg), HybridEngineRollout(engine, tokenizer,
                                                                                                     cfg=cfg)


# ---- the config's fields and the rollout's attributes -------------------------------------------------------------

@pytest.mark.parametrize("name,value", [(n, v) for n, values in VALUES.items() for v in values])
def test_each_deepspeed_field_is_a_keyword_of_ours_and_reads_back_as_set(name, value, tiny_models, tokenizer):
    theirs, ours = DeepSpeedConfig(**{name: value}), HybridEngineRolloutConfig(**{name: value})
    assert getattr(ours, name) == getattr(theirs, name) == value
    read = HybridEngineRolloutConfig.from_any(theirs)
    for field in dataclasses.fields(DeepSpeedConfig):  # DeepSpeed's config object read whole: every field as set
        assert getattr(read, field.name) == getattr(theirs, field.name), field.name
    model = tiny_models["llama-tiny"]
    deepspeeds = DeepSpeedRollout(SimpleNamespace(module=model), tokenizer, cfg=theirs)
    from_theirs = HybridEngineRollout(model, tokenizer, cfg=theirs)
    for field in dataclasses.fields(DeepSpeedConfig):  # the rollout's attributes, built from DeepSpeed's object
        assert getattr(from_theirs, field.name) == getattr(deepspeeds, field.name), field.name
    # built from ours, the field given reads as given (the others say what ours does: MIGRATING.md)
    assert getattr(HybridEngineRollout(model, tokenizer, cfg=ours), name) == getattr(deepspeeds, name) == value


def test_deepspeeds_names_map_onto_ours_and_a_contradiction_says_why():
    cfg = HybridEngineRolloutConfig(use_graph_capture=True, enable_cache_trimming=True, seed=0)
    assert (cfg.compile_decode, cfg.compact_rows, cfg.seed) == (True, True, 0)
    assert cfg.replace(seed=1).use_graph_capture is True and cfg.replace(use_graph_capture=False).compile_decode is False
    with pytest.raises(ValueError, match="use_graph_capture=False contradicts compile_decode=True"):
        HybridEngineRolloutConfig(use_graph_capture=False, compile_decode=True)
    with pytest.raises(ValueError, match="use_shared_prefill=True needs shared_prefill=True"):
        HybridEngineRolloutConfig(use_shared_prefill=True, shared_prefill=False)
    with pytest.raises(ValueError, match="needs strategy='static'"):
        HybridEngineRolloutConfig(use_graph_capture=True, strategy="generate")
    with pytest.raises(TypeError, match="use_shared_prefill must be a bool"):
        HybridEngineRolloutConfig(use_shared_prefill="yes")


# ---- the batch ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("wrap", ["module-wrapper", "deepspeed-engine"])
def test_batches_have_deepspeeds_width_and_tokens(chain, n, wrap):
    """Rows that stop at different steps, through an object whose ``.module`` is the model and through a real
    DeepSpeed engine: the same ids, masks and starts, ``P + max_new_tokens`` columns wide."""
    model, tokenizer = chain
    engine = SimpleNamespace(module=model) if wrap == "module-wrapper" else build_engine(model, 0)
    request = left_padded([[5, 6], [10], [3, 4, 5]], PAD)
    sampling = SamplingConfig(max_new_tokens=9, temperature=0.0, n_samples_per_prompt=n)
    expected = DeepSpeedRollout(engine, tokenizer).generate(request, sampling)
    got = HybridEngineRollout(engine, tokenizer).generate(request, sampling)
    assert got.input_ids.shape == (3 * n, 3 + 9)
    assert torch.equal(got.input_ids, expected.input_ids) and torch.equal(got.attention_mask, expected.attention_mask)
    assert torch.equal(got.response_start_idx, expected.response_start_idx)
    assert got.attention_mask[:, 3:].sum(dim=1).tolist() != [9] * (3 * n), "some rows stop early"


def test_the_trimmed_width_is_deepspeeds_batch_cut_at_the_longest_response(chain):
    model, tokenizer = chain
    request = left_padded([[5, 6], [10]], PAD)
    sampling = SamplingConfig(max_new_tokens=9, temperature=0.0, n_samples_per_prompt=2)
    expected = DeepSpeedRollout(SimpleNamespace(module=model), tokenizer).generate(request, sampling)
    got = HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(response_width="longest")).generate(
        request, sampling)
    width = got.seq_len
    assert width < expected.seq_len and got.attention_mask[:, -1].any()  # the longest response's last column
    assert torch.equal(got.input_ids, expected.input_ids[:, :width])
    assert torch.equal(got.attention_mask, expected.attention_mask[:, :width])
    assert not expected.attention_mask[:, width:].any()


# ---- the profile --------------------------------------------------------------------------------------------------

def test_a_plain_calls_profile_answers_deepspeeds_keys_with_its_facts(chain):
    model, tokenizer = chain
    request = left_padded([[5, 6], [10]], PAD)
    sampling = SamplingConfig(max_new_tokens=7, temperature=0.0, n_samples_per_prompt=2)
    theirs, ours = both(model, tokenizer, DeepSpeedConfig(enable_profiling=True))
    theirs.generate(request, sampling)
    batch = ours.generate(request, sampling)
    expected, profile = theirs.get_last_profile(), ours.get_last_profile()
    assert set(expected) == PLAIN_KEYS
    assert PLAIN_KEYS | CONTINUOUS_KEYS <= set(profile) and PLAIN_KEYS | CONTINUOUS_KEYS <= set(profile.to_dict())
    for key in ("batch_size", "num_samples_per_prompt", "prompt_length", "response_length"):
        assert profile[key] == expected[key], key
    # DeepSpeed counts every row to the batch's width; ours the real tokens
    assert expected["num_generated_tokens"] == batch.attention_mask.shape[0] * 7
    assert profile["num_generated_tokens"] == int(batch.attention_mask[:, 2:].sum())
    assert profile["active_batch_size"] == profile["continuous_batch_size"] == 4  # every row decodes at once
    assert profile["num_prefill_forwards"] == 1 and profile["scheduler_overhead_ms"] > 0


def continuous_call(rollout, request, sampling):
    """DeepSpeed's continuous batching, or the error it raises on this transformers (None when it ran)."""
    try:
        return rollout.generate(request, sampling), None
    except AttributeError as error:  # DeepSpeed 0.19.8's cache on transformers 5.24: docs/MIGRATING.md says so
        assert "get_query_offset" in str(error)
        return None, error


def test_a_continuous_calls_profile_and_stats_answer_deepspeeds_keys_with_measured_figures(chain):
    model, tokenizer = chain
    request = left_padded([[5, 6], [10], [11], [3, 4, 5], [13]], PAD)
    sampling = SamplingConfig(max_new_tokens=9, temperature=0.0, continuous_batch_size=2)
    theirs, ours = both(model, tokenizer, DeepSpeedConfig(enable_profiling=True))
    assert theirs.get_last_continuous_stats() is None and ours.get_last_continuous_stats() is None
    ours.generate(request, SamplingConfig(max_new_tokens=3, temperature=0.0))
    assert ours.get_last_continuous_stats() is None  # a plain call is not a continuous one
    batch = ours.generate(request, sampling)
    profile, stats = ours.get_last_profile(), ours.get_last_continuous_stats()
    assert CONTINUOUS_KEYS <= set(profile) and CONTINUOUS_KEYS <= set(profile.to_dict())
    assert 0 < profile["scheduler_overhead_ms"] <= profile["generation_ms"]  # real stage times
    assert 0 < profile["cache_management_overhead_ms"] <= profile["generation_ms"]
    assert profile["num_prefill_forwards"] == profile.admission_rounds + 1 > 1
    assert profile["active_batch_size"] == profile["continuous_batch_size"] == 2
    assert set(stats) == STATS_KEYS
    assert stats["decode_steps"] == profile.decode_steps and stats["trim_count"] == profile.compactions
    assert stats["end_to_end_ms"] == profile.total_ms and stats["tokens_per_second"] == profile.tokens_per_second
    assert stats["trim_latency_ms"] == (profile.compaction_ms or 0.0) and stats["trimmed_columns"] == 0
    assert (stats["trim_bytes_moved"] > 0) == (stats["trim_count"] > 0)
    assert stats["peak_cache_length"] == 3 + int(batch.attention_mask[:, 3:].sum(dim=1).max()) - 1
    assert stats["cache_memory_bytes"] > 0 and stats["cache_capacity"] >= 3 + 9
    expected, failure = continuous_call(theirs, request, sampling)
    if failure is None:  # DeepSpeed's ran: the same rows (its batch is as wide as its longest response)
        assert torch.equal(batch.input_ids[:, :expected.seq_len], expected.input_ids)
        assert set(theirs.get_last_profile()) == CONTINUOUS_KEYS
        assert theirs.get_last_continuous_stats()["decode_steps"] == stats["decode_steps"]


def test_an_unprofiled_continuous_call_has_stats_without_times(chain):
    model, tokenizer = chain
    rollout = HybridEngineRollout(model, tokenizer)
    rollout.generate(left_padded([[5, 6], [10], [11]], PAD), SamplingConfig(max_new_tokens=5, temperature=0.0,
                                                                           continuous_batch_size=1))
    stats = rollout.get_last_continuous_stats()
    assert (stats["end_to_end_ms"], stats["tokens_per_second"], stats["trim_latency_ms"]) == (None, None, None)
    assert stats["decode_steps"] > 0 and rollout.get_last_profile() is None


# ---- build_rollout ------------------------------------------------------------------------------------------------

def test_build_rollout_takes_what_deepspeeds_takes_and_warns_once_naming_what_it_ignores(chain):
    """DeepSpeedExamples' OPSD trainer passes ``student_model_path=``: DeepSpeed's factory drops it, ours too."""
    model, tokenizer = chain
    engine = build_engine(model, 0)
    request, sampling = left_padded([[5, 6], [10]], PAD), SamplingConfig(max_new_tokens=6, temperature=0.0)
    theirs = deepspeed_rollout.build_rollout(RolloutConfig(), engine, tokenizer, student_model_path="/ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own rule: once per place it is raised from
        built = [opsd_rollout.build_rollout(RolloutConfig(), engine, tokenizer, student_model_path="/ckpt")
                 for _ in range(3)]
    messages = [str(w.message) for w in caught if "ignores keyword arguments" in str(w.message)]
    assert len(messages) == 1 and "['student_model_path']" in messages[0]
    expected = theirs.generate(request, sampling)
    for ours in built:
        assert torch.equal(ours.generate(request, sampling).input_ids, expected.input_ids)


def test_migratings_example_of_deepspeeds_continuous_batching_runs_as_it_says():
    """docs/MIGRATING.md's example fails as it says on this transformers, or runs where DeepSpeed's path works."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "MIGRATING.md").read_text()
    code = next(block for block in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "get_query_offset" in block)
    try:
        exec(compile(code, "MIGRATING.md", "exec"), {"__name__": "migrating"})
    except AttributeError as error:
        assert "get_query_offset" in str(error)
