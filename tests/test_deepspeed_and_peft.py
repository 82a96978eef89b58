"""The DeepSpeed engine path (ZeRO-0, ZeRO-3, one CPU process, gloo) gives the bare model's tokens, and a
PEFT LoRA model keeps its prefill/decode split."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import left_padded
from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutOptions, SamplingConfig
from opsd_rollout.deepspeed_engine import build_engine

PROFILED = HybridEngineRolloutConfig(enable_profiling=True)


def request_for(tokenizer):
    enc = tokenizer(["zero three gathers", "ok"], padding=True, return_tensors="pt")
    from opsd_rollout import RolloutRequest

    return RolloutRequest(enc.input_ids, enc.attention_mask)


@pytest.fixture(scope="module")
def engines(tiny_models):
    """One engine per (model, ZeRO stage), shared by the strategy/gather variants."""
    return {(name, stage): build_engine(copy.deepcopy(tiny_models[name]), stage)
            for name in ("llama-tiny", "gpt2-tiny") for stage in (0, 3)}


@pytest.mark.parametrize("zero_stage,gather", [(0, "once"), (3, "once"), (3, "per_layer")])
@pytest.mark.parametrize("strategy,layout", [("generate", None), ("static", "copied"), ("static", "shared_prefix")])
@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
def test_deepspeed_engine_matches_bare_model(tiny_models, tokenizer, engines, zero_stage, gather, strategy, layout,
                                             name):
    model = tiny_models[name]
    request = request_for(tokenizer)
    sampling = SamplingConfig(max_new_tokens=5, n_samples_per_prompt=2, temperature=0.0)
    expected = HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(strategy="generate")).generate(
        request, sampling)
    config = HybridEngineRolloutConfig(enable_profiling=True, strategy=strategy, zero3_gather=gather,
                                       options=RolloutOptions(
                                           shared_prefix_min_prompt=1 if layout == "shared_prefix" else 4096))
    rollout = HybridEngineRollout(engines[name, zero_stage], tokenizer, config)
    batch = rollout.generate(request, sampling)
    assert torch.equal(batch.input_ids, expected.input_ids)
    assert torch.equal(batch.attention_mask, expected.attention_mask)
    profile = rollout.get_last_profile()
    assert (profile.zero_stage, profile.strategy, profile.kv_layout) == (zero_stage, strategy, layout)
    if zero_stage == 3:
        assert profile.param_gather_ms > 0 and profile.param_gather_count > 0
    assert profile.prefill_forwards == 1 and profile.decode_steps == batch.seq_len - request.prompt_ids.shape[1] - 1
    assert profile.prefill_ms > 0 and profile.decode_ms > 0


def lora(model):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(copy.deepcopy(model), config).eval()


def test_peft_lora_model_keeps_the_prefill_decode_split(tiny_models, tokenizer):
    peft_model = lora(tiny_models["llama-tiny"])
    rollout = HybridEngineRollout(peft_model, tokenizer, PROFILED)
    request = left_padded([[5, 6, 7, 8], [9, 10]], 0)
    batch = rollout.generate(request, SamplingConfig(max_new_tokens=6, temperature=0.0))
    profile = rollout.get_last_profile()
    response = batch.seq_len - 4
    assert profile.prefill_forwards == 1 and profile.decode_steps == response - 1
    assert profile.prefill_ms > 0 and profile.decode_ms > 0
    with torch.no_grad():
        ref = peft_model.generate(input_ids=request.prompt_ids, attention_mask=request.prompt_attention_mask,
                                  max_new_tokens=6, do_sample=False, eos_token_id=[2], pad_token_id=0)
    assert torch.equal(batch.input_ids[:, :ref.shape[1]], ref[:, :batch.seq_len])


def test_gather_once_falls_back_to_per_layer_over_budget(engines, tokenizer, caplog):
    config = HybridEngineRolloutConfig(zero3_gather="once", options=RolloutOptions(gather_memory_budget_bytes=1024))
    rollout = HybridEngineRollout(engines["llama-tiny", 3], tokenizer, config)
    with caplog.at_level("WARNING"):
        rollout.generate(left_padded([[5, 6]], 0), SamplingConfig(max_new_tokens=2))
    assert "gathers per layer" in caplog.text and "exceed the gather budget" in caplog.text
    assert {r.levelname for r in caplog.records if "gathers per layer" in r.getMessage()} == {"WARNING"}


def test_the_default_gather_budget_counts_memory_the_caching_allocator_holds_unused(monkeypatch):
    """After a training step torch's allocator keeps freed blocks reserved; mem_get_info calls them taken."""
    from opsd_rollout.rollout import gather

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1_000, 10_000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 6_000)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 2_500)
    assert gather.available_bytes(torch.device("cuda", 0)) == 1_000 + 6_000 - 2_500
    assert gather.default_budget_bytes(torch.device("cuda", 0)) == int(0.8 * 4_500)


def test_deepspeed_engine_around_a_peft_model(tiny_models, tokenizer):
    engine = build_engine(lora(tiny_models["llama-tiny"]), 0)
    rollout = HybridEngineRollout(engine, tokenizer, PROFILED)
    rollout.generate(left_padded([[5, 6, 7]], 0), SamplingConfig(max_new_tokens=4, temperature=0.0))
    assert rollout.get_last_profile().prefill_forwards == 1
