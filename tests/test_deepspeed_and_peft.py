"""The DeepSpeed engine path (ZeRO-0, ZeRO-3, one CPU process, gloo) gives the bare model's tokens, and a
PEFT LoRA model keeps its prefill/decode split."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import left_padded
from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, SamplingConfig
from opsd_rollout.deepspeed_engine import build_engine

PROFILED = HybridEngineRolloutConfig(enable_profiling=True)


def request_for(tokenizer):
    enc = tokenizer(["zero three gathers", "ok"], padding=True, return_tensors="pt")
    from opsd_rollout import RolloutRequest

    return RolloutRequest(enc.input_ids, enc.attention_mask)


@pytest.mark.parametrize("zero_stage", [0, 3])
@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
def test_deepspeed_engine_matches_bare_model(tiny_models, tokenizer, zero_stage, name):
    model = tiny_models[name]
    request = request_for(tokenizer)
    sampling = SamplingConfig(max_new_tokens=5, n_samples_per_prompt=2, temperature=0.0)
    expected = HybridEngineRollout(model, tokenizer).generate(request, sampling)
    engine = build_engine(copy.deepcopy(model), zero_stage)
    rollout = HybridEngineRollout(engine, tokenizer, PROFILED)
    batch = rollout.generate(request, sampling)
    assert torch.equal(batch.input_ids, expected.input_ids)
    assert torch.equal(batch.attention_mask, expected.attention_mask)
    profile = rollout.get_last_profile()
    assert profile.zero_stage == zero_stage
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


def test_deepspeed_engine_around_a_peft_model(tiny_models, tokenizer):
    engine = build_engine(lora(tiny_models["llama-tiny"]), 0)
    rollout = HybridEngineRollout(engine, tokenizer, PROFILED)
    rollout.generate(left_padded([[5, 6, 7]], 0), SamplingConfig(max_new_tokens=4, temperature=0.0))
    assert rollout.get_last_profile().prefill_forwards == 1
