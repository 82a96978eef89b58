"""The public expectations of DeepSpeed's own rollout unit tests and interface docstrings, checked against ours:
the exported names, ``build_rollout`` (signature, defaults, errors, configs), construction with ``cfg=`` (ours
and DeepSpeed's config objects), ``.engine``, ``.tokenizer``, ``sync_weights(step)`` returning ``None``,
``shutdown()``, the ``RolloutBatch`` invariants, ``SamplingConfig``'s defaults (``top_k <= 0`` disables top-k,
``temperature <= 0`` is greedy), the profile's keys; and every field of DeepSpeed's rollout configs honoured,
mapped or refused as docs/MIGRATING.md says, none ignored."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from types import SimpleNamespace

import deepspeed.runtime.rollout as deepspeed_rollout
import pytest
import torch
from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRollout as DeepSpeedRollout
from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig as DeepSpeedRolloutConfig

import opsd_rollout
from conftest import left_padded, reference_rollout
from opsd_rollout import (HybridEngineRollout, HybridEngineRolloutConfig, ResponseTokenBatch, RolloutBatch,
                          RolloutConfig, RolloutEngine, RolloutRequest, SamplingConfig, build_rollout)

MIGRATING = Path(__file__).resolve().parents[1] / "docs" / "MIGRATING.md"


@pytest.fixture()
def model(tiny_models):
    return tiny_models["llama-tiny"]


def request_of(tokenizer) -> RolloutRequest:
    enc = tokenizer(["The student writes", "hi"], padding=True, return_tensors="pt")  # left-padded
    return RolloutRequest(enc.input_ids, enc.attention_mask)


# --- names -------------------------------------------------------------------------------------------------


def test_every_name_deepspeeds_rollout_module_exports_is_ours():
    assert set(deepspeed_rollout.__all__) <= set(opsd_rollout.__all__)
    for name in deepspeed_rollout.__all__:
        assert getattr(opsd_rollout, name) is not None
    # the dataclasses a trainer builds and reads are DeepSpeed's own classes, not look-alikes
    for name in ("RolloutBatch", "RolloutConfig", "RolloutEngine", "RolloutRequest", "SamplingConfig",
                 "ResponseTokenBatch", "JSDLossOutput"):
        assert getattr(opsd_rollout, name) is getattr(deepspeed_rollout, name), name
    assert issubclass(HybridEngineRollout, RolloutEngine)


# --- build_rollout -----------------------------------------------------------------------------------------


def test_build_rollout_has_deepspeeds_signature_and_defaults():
    ours, theirs = inspect.signature(build_rollout), inspect.signature(deepspeed_rollout.build_rollout)
    assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == \
        [(p.name, p.kind, p.default) for p in theirs.parameters.values()]


@pytest.mark.parametrize("factory", [deepspeed_rollout.build_rollout, build_rollout], ids=["deepspeed", "ours"])
def test_build_rollout_raises_deepspeeds_errors(factory, model, tokenizer):
    with pytest.raises(ValueError, match="Unknown rollout engine 'totally_made_up'"):
        factory(RolloutConfig(engine="totally_made_up"), model, tokenizer)
    with pytest.raises(ValueError, match="needs both"):
        factory(RolloutConfig(engine="hybrid_engine"))
    with pytest.raises(ValueError, match="needs both"):
        factory(RolloutConfig(engine="hybrid_engine"), model)
    with pytest.raises(ValueError, match="needs both"):
        factory(RolloutConfig(engine="hybrid_engine"), tokenizer=tokenizer)


@pytest.mark.parametrize("cfg", [RolloutConfig(), RolloutConfig(engine="hybrid_engine"), DeepSpeedRolloutConfig(),
                                 DeepSpeedRolloutConfig(enable_profiling=True), HybridEngineRolloutConfig(),
                                 HybridEngineRolloutConfig(enable_profiling=True, seed=3)],
                         ids=["ds-rollout-default", "ds-rollout", "ds-hybrid", "ds-hybrid-profiling", "ours",
                              "ours-profiling"])
def test_build_rollout_builds_ours_from_deepspeeds_configs_and_ours(cfg, model, tokenizer):
    rollout = build_rollout(cfg, model, tokenizer)
    assert isinstance(rollout, HybridEngineRollout) and isinstance(rollout, RolloutEngine)
    assert rollout.engine is model and rollout.tokenizer is tokenizer
    assert rollout.cfg == HybridEngineRolloutConfig.from_any(cfg)
    rollout.generate(request_of(tokenizer), SamplingConfig(max_new_tokens=2, temperature=0))
    assert (rollout.get_last_profile() is not None) == bool(getattr(cfg, "enable_profiling", False))
    by_keyword = build_rollout(rollout_cfg=cfg, student_engine=model, tokenizer=tokenizer)
    assert by_keyword.cfg == rollout.cfg


def test_build_rollout_reads_keywords_as_our_config_fields_and_ignores_others_with_a_warning(model, tokenizer):
    rollout = build_rollout(RolloutConfig(), model, tokenizer, enable_profiling=True, strategy="generate", seed=7)
    assert (rollout.cfg.enable_profiling, rollout.cfg.strategy, rollout.cfg.seed) == (True, "generate", 7)
    graphs = build_rollout(RolloutConfig(), model, tokenizer, use_graph_capture=True)  # DeepSpeed's names too
    assert graphs.cfg.compile_decode is True and graphs.use_graph_capture is True
    # DeepSpeed's factory drops what it does not know (DeepSpeedExamples' trainer passes student_model_path=)
    with pytest.warns(UserWarning, match=r"ignores keyword arguments .*\['ref_model', 'student_model_path'\]"):
        ignoring = build_rollout(RolloutConfig(), model, tokenizer, student_model_path="/ckpt", ref_model=model,
                                 seed=7)
    assert ignoring.cfg == build_rollout(RolloutConfig(), model, tokenizer, seed=7).cfg
    with pytest.raises(ValueError, match="strategy must be one of"):  # a field's value is validated as ours
        build_rollout(RolloutConfig(), model, tokenizer, strategy="vllm")
    with pytest.raises(TypeError, match="rollout_cfg must be a rollout config"):
        build_rollout(None, model, tokenizer)


# --- construction, attributes, sync_weights, shutdown ------------------------------------------------------


@pytest.mark.parametrize("cfg", [None, HybridEngineRolloutConfig(), DeepSpeedRolloutConfig(), RolloutConfig()],
                         ids=["none", "ours", "ds-hybrid", "ds-rollout"])
def test_construction_with_cfg_stores_engine_tokenizer_and_options(cfg, model, tokenizer):
    """DeepSpeed's tests: ``HybridEngineRollout(engine, tok, cfg=cfg)`` keeps ``engine`` and ``tokenizer`` as
    given, and ``use_graph_capture`` reads False by default."""
    rollout = HybridEngineRollout(model, tokenizer, cfg=cfg)
    assert rollout.engine is model and rollout.tokenizer is tokenizer
    assert rollout.use_graph_capture is False and rollout.enable_profiling is False
    positional = HybridEngineRollout(model, tokenizer, cfg)
    assert positional.cfg == rollout.cfg


def test_deepspeed_config_options_read_back_under_deepspeeds_names(model, tokenizer):
    rollout = HybridEngineRollout(model, tokenizer, cfg=DeepSpeedRolloutConfig(enable_profiling=True,
                                                                             use_shared_prefill=True))
    assert rollout.enable_profiling is True and rollout.use_shared_prefill is True
    unshared = HybridEngineRollout(model, tokenizer, cfg=HybridEngineRolloutConfig(shared_prefill=False))
    assert unshared.use_shared_prefill is False


def test_sync_weights_returns_none_and_changes_nothing(model, tokenizer):
    rollout = HybridEngineRollout(model, tokenizer)
    sampling = SamplingConfig(max_new_tokens=4, temperature=0)
    before = rollout.generate(request_of(tokenizer), sampling)
    assert rollout.sync_weights(step=0) is None
    assert rollout.sync_weights(5) is None
    assert torch.equal(rollout.generate(request_of(tokenizer), sampling).input_ids, before.input_ids)


def test_shutdown_returns_none_is_idempotent_and_ends_the_rollout(model, tokenizer):
    rollout = HybridEngineRollout(model, tokenizer, cfg=HybridEngineRolloutConfig(enable_profiling=True))
    rollout.generate(request_of(tokenizer), SamplingConfig(max_new_tokens=2, temperature=0))
    assert rollout.shutdown() is None and rollout.shutdown() is None
    assert rollout.get_last_profile() is None
    with pytest.raises(RuntimeError, match="after shutdown"):
        rollout.generate(request_of(tokenizer), SamplingConfig(max_new_tokens=2))


# --- RolloutRequest / RolloutBatch invariants --------------------------------------------------------------


def test_request_and_batch_validate_shapes_as_deepspeed_documents():
    with pytest.raises(ValueError, match="must be 2-D"):
        RolloutRequest(prompt_ids=torch.zeros(8), prompt_attention_mask=torch.ones(8))
    with pytest.raises(ValueError, match="does not match"):
        RolloutRequest(prompt_ids=torch.zeros(2, 4, dtype=torch.long), prompt_attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="1-D of length"):
        RolloutBatch(input_ids=torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 4),
                     response_start_idx=torch.tensor([4]))


@pytest.mark.parametrize("n", [1, 3])
def test_generated_batches_keep_deepspeeds_invariants(model, tokenizer, n):
    """Rows are ``B * n``; ``input_ids`` is the left-padded prompt then the response; every row's response
    starts at the prompt width ``T_p``, left padding or not; ``ResponseTokenBatch`` reads the batch."""
    request = request_of(tokenizer)
    B, T_p = request.prompt_ids.shape
    assert not request.prompt_attention_mask[:, 0].all(), "one prompt is left-padded"
    batch = HybridEngineRollout(model, tokenizer).generate(request, SamplingConfig(max_new_tokens=5,
                                                                                   n_samples_per_prompt=n))
    assert isinstance(batch, RolloutBatch)
    assert batch.batch_size == B * n and batch.input_ids.shape == batch.attention_mask.shape
    assert T_p < batch.seq_len <= T_p + 5
    assert batch.response_start_idx.tolist() == [T_p] * (B * n)
    assert batch.response_start_idx.dtype in (torch.int32, torch.int64)
    assert torch.equal(batch.input_ids[:, :T_p], request.prompt_ids.repeat_interleave(n, dim=0))
    targets = ResponseTokenBatch.from_rollout(batch)
    assert not targets.response_mask[:, :T_p - 1].any() and targets.response_mask[:, T_p - 1].all()


# --- SamplingConfig -----------------------------------------------------------------------------------------


def test_sampling_config_defaults_are_deepspeeds_and_run(model, tokenizer):
    cfg = SamplingConfig(max_new_tokens=32)
    assert (cfg.temperature, cfg.top_p, cfg.top_k, cfg.n_samples_per_prompt, cfg.continuous_batch_size) == \
        (1.0, 1.0, -1, 1, None)
    batch = HybridEngineRollout(model, tokenizer).generate(request_of(tokenizer), SamplingConfig(max_new_tokens=3))
    assert batch.batch_size == 2


def sampled(model, tokenizer, top_k: int) -> list[list[int]]:
    rollout = HybridEngineRollout(model, tokenizer, cfg=HybridEngineRolloutConfig(seed=11))
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.5, top_k=top_k, n_samples_per_prompt=4)
    return rollout.generate(request_of(tokenizer), sampling).input_ids.tolist()


def test_top_k_at_or_below_zero_disables_top_k(model, tokenizer):
    """With one seed, ``top_k`` of -1, 0 and -5 draw what no filter (``top_k`` = the vocabulary) draws, and a
    real filter draws something else."""
    unfiltered = sampled(model, tokenizer, model.config.vocab_size)
    for top_k in (-1, 0, -5):
        assert sampled(model, tokenizer, top_k) == unfiltered, top_k
    assert sampled(model, tokenizer, 2) != unfiltered


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_temperature_at_or_below_zero_is_greedy(model, tokenizer, temperature):
    request = request_of(tokenizer)
    batch = HybridEngineRollout(model, tokenizer).generate(
        request, SamplingConfig(max_new_tokens=6, temperature=temperature, n_samples_per_prompt=2))
    ids, mask = reference_rollout(model, request, n=2, max_new_tokens=6, pad_token_id=tokenizer.pad_token_id,
                                  eos_ids=[tokenizer.eos_token_id])
    assert torch.equal(batch.input_ids, ids) and torch.equal(batch.attention_mask, mask)


# --- the profile -------------------------------------------------------------------------------------------


def test_the_profile_answers_every_key_of_deepspeeds(model, tokenizer):
    """DeepSpeed's ``get_last_profile()`` is a dict; ours reads as a mapping under each of its keys."""
    request = left_padded([[40, 41, 42], [50, 51]], tokenizer.pad_token_id)
    sampling = SamplingConfig(max_new_tokens=4, temperature=0, n_samples_per_prompt=2)
    theirs = DeepSpeedRollout(SimpleNamespace(module=model), tokenizer, cfg=DeepSpeedRolloutConfig(enable_profiling=True))
    theirs.generate(request, sampling)
    ours = HybridEngineRollout(model, tokenizer, cfg=DeepSpeedRolloutConfig(enable_profiling=True))
    ours.generate(request, sampling)
    expected, profile = theirs.get_last_profile(), ours.get_last_profile()
    assert expected and set(expected) <= set(profile)
    for key in ("batch_size", "num_samples_per_prompt", "prompt_length", "response_length", "num_decode_forwards"):
        assert profile[key] == expected[key], key  # same facts; times differ, and we count real tokens only


# --- every DeepSpeed config field: honoured, mapped or refused ---------------------------------------------

DEEPSPEED_CONFIGS = {"HybridEngineRolloutConfig": DeepSpeedRolloutConfig, "RolloutConfig": RolloutConfig,
                     "SamplingConfig": SamplingConfig}


def readme_field_rows() -> dict[str, str]:
    """``Class.field`` -> its verdict in docs/MIGRATING.md's list of DeepSpeed's config fields."""
    rows = re.findall(r"^- `(\w+)\.(\w+)` \*\*(honoured|mapped|refused)\*\*", MIGRATING.read_text(), flags=re.M)
    return {f"{cls}.{field}": verdict for cls, field, verdict in rows}


def test_the_readme_tables_every_field_of_deepspeeds_rollout_configs():
    fields = {f"{name}.{f.name}" for name, cls in DEEPSPEED_CONFIGS.items() for f in dataclasses.fields(cls)}
    assert set(readme_field_rows()) == fields


def test_the_verdicts_the_readme_gives_are_what_the_tests_check():
    assert readme_field_rows() == {**{f"SamplingConfig.{f.name}": "honoured" for f in dataclasses.fields(SamplingConfig)},
                                   **{name: "mapped" for name in MAPPED},
                                   "HybridEngineRolloutConfig.enable_profiling": "honoured",
                                   "RolloutConfig.engine": "honoured"}


MAPPED = ("HybridEngineRolloutConfig.use_graph_capture", "HybridEngineRolloutConfig.use_shared_prefill",
          "RolloutConfig.use_graph_capture", "HybridEngineRolloutConfig.align_decode_fronts",
          "HybridEngineRolloutConfig.enable_cache_trimming", "HybridEngineRolloutConfig.continuous_cache_capacity")


def test_deepspeeds_continuous_batching_fields_map_onto_ours(model, tokenizer):
    """Aligned fronts and cache trimming are what our slots already do (same rows either way); the cache capacity
    bounds a slot's columns, and a rollout that needs more is refused naming it."""
    request = left_padded([[40, 41, 42], [50, 51]], tokenizer.pad_token_id)
    sampling = SamplingConfig(max_new_tokens=6, temperature=0, n_samples_per_prompt=2, continuous_batch_size=3)
    expected = HybridEngineRollout(model, tokenizer).generate(request, SamplingConfig(
        max_new_tokens=6, temperature=0, n_samples_per_prompt=2)).input_ids
    for aligned in (False, True):
        cfg = DeepSpeedRolloutConfig(align_decode_fronts=aligned, enable_cache_trimming=True,
                                     continuous_cache_capacity=9)
        ours = HybridEngineRolloutConfig.from_any(cfg)
        assert ours.compact_rows is True and ours.continuous_cache_capacity == 9
        assert torch.equal(build_rollout(cfg, model, tokenizer).generate(request, sampling).input_ids, expected)
    tight = HybridEngineRollout(model, tokenizer, cfg=DeepSpeedRolloutConfig(continuous_cache_capacity=8))
    with pytest.raises(ValueError, match="continuous_cache_capacity 8"):
        tight.generate(request, sampling)


@pytest.mark.parametrize("cfg_type", [DeepSpeedRolloutConfig, RolloutConfig])
def test_graph_capture_maps_to_compiled_decode(cfg_type, model, tokenizer):
    cfg = HybridEngineRolloutConfig.from_any(cfg_type(use_graph_capture=True))
    assert cfg.compile_decode is True and cfg.strategy == "static"
    assert build_rollout(cfg_type(use_graph_capture=True), model, tokenizer).use_graph_capture is True


@pytest.mark.parametrize("use_shared_prefill", [False, True])
def test_shared_prefill_maps_onto_ours_and_gives_deepspeeds_tokens(use_shared_prefill, model, tokenizer):
    """DeepSpeed's flag only chooses how the prompts are prefilled, never what is generated; ours shares the
    prefill either way (``shared_prefill=False`` on our config turns it off), with the tokens DeepSpeed's
    rollout returns."""
    cfg = DeepSpeedRolloutConfig(use_shared_prefill=use_shared_prefill)
    ours = HybridEngineRollout(model, tokenizer, cfg=cfg)
    assert ours.use_shared_prefill is use_shared_prefill  # read back as given
    assert ours.cfg.shared_prefill is True  # and ours shares the prefill either way
    request = left_padded([[40, 41, 42], [50, 51]], tokenizer.pad_token_id)
    sampling = SamplingConfig(max_new_tokens=5, temperature=0, n_samples_per_prompt=3)
    theirs = DeepSpeedRollout(SimpleNamespace(module=model), tokenizer, cfg=DeepSpeedRolloutConfig())
    expected = theirs.generate(request, sampling)
    got = ours.generate(request, sampling)
    assert torch.equal(got.input_ids, expected.input_ids)  # DeepSpeed's width: max_new_tokens columns
    assert torch.equal(got.attention_mask, expected.attention_mask)
