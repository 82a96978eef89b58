"""Greedy rollouts on the built-in architectures equal transformers' generate on the expanded prompts,
with profiling on or off."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_PRESETS, assert_batch_contract, prompts_with_padding_and_holes, reference_rollout
from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, SamplingConfig
from opsd_rollout.models import EOS_ID, PAD_ID


@pytest.mark.parametrize("name", TINY_PRESETS)
@pytest.mark.parametrize("n", [1, 3])
def test_greedy_equals_generate_on_expanded_prompts(tiny_models, tokenizer, name, n):
    model = tiny_models[name]
    request = prompts_with_padding_and_holes(tokenizer)
    sampling = SamplingConfig(max_new_tokens=6, n_samples_per_prompt=n, temperature=0.0)
    plain = HybridEngineRollout(model, tokenizer).generate(request, sampling)
    profiled_rollout = HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(enable_profiling=True))
    profiled = profiled_rollout.generate(request, sampling)
    ref_ids, ref_mask = reference_rollout(model, request, n=n, max_new_tokens=6, pad_token_id=PAD_ID,
                                          eos_ids=[EOS_ID])
    for batch in (plain, profiled):
        assert torch.equal(batch.input_ids, ref_ids)
        assert torch.equal(batch.attention_mask, ref_mask)
        assert_batch_contract(batch, request, n=n, max_new_tokens=6, pad_token_id=PAD_ID, eos_ids=[EOS_ID])
    assert profiled_rollout.get_last_profile().strategy == "static"  # the default


def test_samples_of_one_prompt_are_identical_under_greedy(tiny_models, tokenizer):
    request = prompts_with_padding_and_holes(tokenizer)
    batch = HybridEngineRollout(tiny_models["llama-tiny"], tokenizer).generate(
        request, SamplingConfig(max_new_tokens=5, n_samples_per_prompt=4, temperature=-1.0))
    for prompt in range(3):
        rows = batch.input_ids[prompt * 4:(prompt + 1) * 4]
        assert (rows == rows[0]).all()


def test_sampling_draws_differ_and_respect_top_k_one(tiny_models, tokenizer):
    request = prompts_with_padding_and_holes(tokenizer)
    rollout = HybridEngineRollout(tiny_models["llama-tiny"], tokenizer)
    torch.manual_seed(0)
    sampled = rollout.generate(request, SamplingConfig(max_new_tokens=6, n_samples_per_prompt=4, temperature=1.5))
    assert len({tuple(r) for r in sampled.input_ids[:4].tolist()}) > 1
    greedy = rollout.generate(request, SamplingConfig(max_new_tokens=6, temperature=0.0))
    top1 = rollout.generate(request, SamplingConfig(max_new_tokens=6, temperature=1.0, top_k=1))
    assert torch.equal(top1.input_ids, greedy.input_ids)
