"""The RolloutBatch contract on a model whose next token is a chosen function of the current one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import (assert_batch_contract, chain_table, left_padded, make_tokenizer, reference_rollout,
                      transition_model)
from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutRequest, SamplingConfig

V, PAD, EOS = 16, 0, 2


STRATEGIES = ["generate", "static"]


@pytest.fixture(params=STRATEGIES)
def strategy(request):
    return request.param


def rollout_of(table, *, pad=PAD, eos=EOS, config_eos=None, profile=False, strategy="generate",
               width="max_new_tokens"):
    model = transition_model(table, eos_token_id=config_eos)
    cfg = HybridEngineRolloutConfig(enable_profiling=profile, strategy=strategy, response_width=width)
    rollout = HybridEngineRollout(model, make_tokenizer(pad, eos), cfg)
    assert rollout.strategy.name == strategy
    return rollout, model


def run(rollout, prompts, *, n=1, max_new_tokens=6, pad=PAD, request=None):
    request = request or left_padded(prompts, pad)
    batch = rollout.generate(request, SamplingConfig(max_new_tokens=max_new_tokens, n_samples_per_prompt=n,
                                                     temperature=0.0))
    return request, batch


def responses(batch, request):
    P = request.prompt_ids.shape[1]
    return batch.input_ids[:, P:].tolist(), batch.attention_mask[:, P:].tolist()


def test_single_sample_follows_the_table_to_max_new_tokens(strategy):
    rollout, _ = rollout_of(chain_table(V, {}), strategy=strategy)
    request, batch = run(rollout, [[5, 6, 7]], max_new_tokens=4)
    assert responses(batch, request) == ([[8, 9, 10, 11]], [[1, 1, 1, 1]])
    assert_batch_contract(batch, request, n=1, max_new_tokens=4, pad_token_id=PAD, eos_ids=[EOS])


@pytest.mark.parametrize("B", [1, 3])
def test_several_samples_per_prompt_are_repeat_interleaved(B, strategy):
    rollout, _ = rollout_of(chain_table(V, {9: EOS}), strategy=strategy)
    prompts = [[4], [6, 7], [8, 3, 5]][:B]
    request, batch = run(rollout, prompts, n=3, max_new_tokens=6)
    ids, mask = responses(batch, request)
    expected = {4: [5, 6, 7, 8, 9, 2], 7: [8, 9, 2, 0, 0, 0], 5: [6, 7, 8, 9, 2, 0]}
    for row in range(B * 3):
        last = prompts[row // 3][-1]
        assert ids[row] == expected[last][:len(ids[row])]
    assert_batch_contract(batch, request, n=3, max_new_tokens=6, pad_token_id=PAD, eos_ids=[EOS])


def test_eos_at_first_response_position_keeps_deepspeeds_width_or_trims_when_asked(strategy):
    table = chain_table(V, {7: EOS, 11: EOS})
    rollout, _ = rollout_of(table, strategy=strategy)
    request, batch = run(rollout, [[5, 6, 7], [11]], n=2, max_new_tokens=8)
    assert batch.input_ids.shape[1] == 3 + 8  # DeepSpeed's width: max_new_tokens columns, whatever the rows did
    assert responses(batch, request) == ([[2] + [PAD] * 7] * 4, [[1] + [0] * 7] * 4)
    trimmed, _ = rollout_of(table, strategy=strategy, width="longest")
    request, batch = run(trimmed, [[5, 6, 7], [11]], n=2, max_new_tokens=8)
    assert batch.input_ids.shape[1] == 3 + 1  # trimmed to the longest response: one token
    assert responses(batch, request) == ([[2]] * 4, [[1]] * 4)


def test_generated_pad_token_before_eos_stays_in_the_mask(strategy):
    rollout, _ = rollout_of(chain_table(V, {7: PAD, PAD: 9, 9: EOS}), strategy=strategy)
    request, batch = run(rollout, [[5, 7]], max_new_tokens=6)
    assert responses(batch, request) == ([[0, 9, 2, 0, 0, 0]], [[1, 1, 1, 0, 0, 0]])


def test_pad_equal_to_eos_keeps_the_eos_and_masks_what_follows(strategy):
    rollout, _ = rollout_of(chain_table(V, {7: 4, 4: EOS}), pad=EOS, eos=EOS, strategy=strategy)
    request, batch = run(rollout, [[7], [10]], max_new_tokens=5, pad=EOS)
    ids, mask = responses(batch, request)
    assert ids[0] == [4, 2, 2, 2, 2] and mask[0] == [1, 1, 0, 0, 0]
    assert ids[1] == [11, 12, 13, 14, 15] and mask[1] == [1] * 5


def test_nonzero_pad_id_pads_after_eos(strategy):
    rollout, _ = rollout_of(chain_table(V, {6: EOS}), pad=15, strategy=strategy)
    request, batch = run(rollout, [[5], [9]], max_new_tokens=4, pad=15)
    ids, mask = responses(batch, request)
    assert ids[0] == [6, 2, 15, 15] and mask[0] == [1, 1, 0, 0]
    assert ids[1] == [10, 11, 12, 13] and mask[1] == [1, 1, 1, 1]


def test_every_model_generation_config_eos_id_stops_a_row(strategy):
    rollout, _ = rollout_of(chain_table(V, {}), config_eos=[EOS, 12], strategy=strategy)
    request, batch = run(rollout, [[10], [4]], max_new_tokens=6)
    ids, mask = responses(batch, request)
    assert ids[0] == [11, 12, 0, 0, 0, 0] and mask[0] == [1, 1, 0, 0, 0, 0]
    assert ids[1] == [5, 6, 7, 8, 9, 10]


def test_no_eos_within_max_new_tokens_runs_full_width(strategy):
    rollout, _ = rollout_of(chain_table(V, {}), strategy=strategy)
    request, batch = run(rollout, [[3], [8, 9]], n=2, max_new_tokens=5)
    assert batch.input_ids.shape == (4, 2 + 5)
    assert batch.attention_mask[:, 2:].eq(1).all()


def test_prompt_mask_is_returned_exactly_with_left_padding_and_holes(strategy):
    rollout, _ = rollout_of(chain_table(V, {}), strategy=strategy)
    ids = torch.tensor([[0, 0, 5, 6, 7], [9, 4, 0, 12, 13], [3, 3, 3, 3, 3]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 0, 1, 0, 1], [0, 1, 0, 1, 1]])
    request, batch = run(rollout, None, n=2, max_new_tokens=3, request=RolloutRequest(ids, mask))
    assert torch.equal(batch.attention_mask[:, :5], mask.repeat_interleave(2, dim=0))
    assert torch.equal(batch.input_ids[:, :5], ids.repeat_interleave(2, dim=0))
    assert_batch_contract(batch, request, n=2, max_new_tokens=3, pad_token_id=PAD, eos_ids=[EOS])


def test_bool_prompt_mask_keeps_its_dtype(strategy):
    rollout, _ = rollout_of(chain_table(V, {}), strategy=strategy)
    request = left_padded([[5, 6], [7]], PAD)
    request = RolloutRequest(request.prompt_ids, request.prompt_attention_mask.bool())
    _, batch = run(rollout, None, max_new_tokens=2, request=request)
    assert batch.attention_mask.dtype == torch.bool
    assert torch.equal(batch.attention_mask[:, :2], request.prompt_attention_mask)


@pytest.mark.parametrize("strategy_name", STRATEGIES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_contract_and_generate_equivalence_on_random_tables(strategy_name, data):
    """Random transitions, prompts, pad and EOS ids (pad may equal EOS, may be generated before EOS)."""
    table = data.draw(st.lists(st.integers(0, V - 1), min_size=V, max_size=V), label="table")
    pad = data.draw(st.integers(0, V - 1), label="pad")
    eos = data.draw(st.integers(0, V - 1), label="eos")
    extra_eos = data.draw(st.lists(st.integers(0, V - 1), max_size=2), label="config eos")
    prompts = data.draw(st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=5), min_size=1, max_size=4))
    n = data.draw(st.integers(1, 3), label="n")
    max_new = data.draw(st.integers(1, 7), label="max_new_tokens")
    trimmed = data.draw(st.booleans(), label="trimmed")
    rollout, model = rollout_of(table, pad=pad, eos=eos, config_eos=extra_eos or None, strategy=strategy_name,
                                width="longest" if trimmed else "max_new_tokens")
    request, batch = run(rollout, prompts, n=n, max_new_tokens=max_new, pad=pad)
    eos_ids = [eos] + [e for e in extra_eos if e != eos]
    assert_batch_contract(batch, request, n=n, max_new_tokens=max_new, pad_token_id=pad, eos_ids=eos_ids,
                          trimmed=trimmed)
    ref_ids, ref_mask = reference_rollout(model, request, n=n, max_new_tokens=max_new, pad_token_id=pad,
                                          eos_ids=eos_ids, trimmed=trimmed)
    assert torch.equal(batch.input_ids, ref_ids)
    assert torch.equal(batch.attention_mask, ref_mask)


def test_sampling_honours_the_table_when_it_is_sharp(strategy):
    rollout, _ = rollout_of(chain_table(V, {}), strategy=strategy)
    request = left_padded([[5]], PAD)
    batch = rollout.generate(request, SamplingConfig(max_new_tokens=3, temperature=1.0, top_k=3, top_p=0.9,
                                                     n_samples_per_prompt=4))
    assert batch.input_ids[:, 1:].tolist() == [[6, 7, 8]] * 4
