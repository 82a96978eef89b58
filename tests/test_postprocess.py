"""The vectorized post-processing equals a plain per-row reference on random batches."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import reference_postprocess
from opsd_rollout.rollout import postprocess


@st.composite
def raw_batches(draw):
    rows = draw(st.integers(1, 6))
    prompt_len = draw(st.integers(1, 6))
    width = draw(st.integers(1, 8))
    vocab = draw(st.integers(3, 12))
    pad = draw(st.sampled_from([0, vocab - 1, draw(st.integers(0, vocab - 1))]))
    eos_ids = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3, unique=True))
    if draw(st.booleans()):
        eos_ids[0] = pad  # pad == EOS
    ints = st.integers(0, vocab - 1)
    prompt = torch.tensor(draw(st.lists(st.lists(ints, min_size=prompt_len, max_size=prompt_len), min_size=rows,
                                        max_size=rows)))
    # left padding with holes: any 0/1 pattern with at least one 1 per row
    mask_rows = draw(st.lists(st.lists(st.integers(0, 1), min_size=prompt_len, max_size=prompt_len), min_size=rows,
                              max_size=rows))
    mask = torch.tensor([m if any(m) else m[:-1] + [1] for m in mask_rows])
    responses = torch.tensor(draw(st.lists(st.lists(ints, min_size=width, max_size=width), min_size=rows,
                                           max_size=rows)))
    return prompt, mask, responses, pad, eos_ids


@settings(max_examples=300, deadline=None)
@given(raw_batches())
def test_vectorized_post_processing_equals_reference(case):
    prompt, mask, responses, pad, eos_ids = case
    lengths = postprocess.response_lengths(responses, torch.tensor(eos_ids))
    width = int(lengths.max())
    sequences = torch.cat([prompt, responses], dim=1)
    ref_ids, ref_mask = reference_postprocess(sequences.clone(), prompt, mask, eos_ids, pad)
    ids = postprocess.finalize_input_ids(sequences, prompt.shape[1], lengths, width, pad)
    attention = postprocess.build_attention_mask(mask, lengths, width)
    assert ids.is_contiguous()
    assert torch.equal(ids, ref_ids)
    assert torch.equal(attention, ref_mask)


@settings(max_examples=200, deadline=None)
@given(raw_batches(), st.integers(0, 3))
def test_tokens_padded_already_are_finalized_without_the_mask(case, wider):
    """``padded=True`` (the decode loop's output: padding after each row's end, its lengths handed over) reads no
    token and gives what masking gives, at the batch's width, trimmed or widened."""
    prompt, mask, responses, pad, eos_ids = case
    lengths = postprocess.response_lengths(responses, torch.tensor(eos_ids))
    responses = responses.masked_fill(~postprocess.response_valid(lengths, responses.shape[1]), pad)
    for width in (int(lengths.max()), responses.shape[1] + wider):
        sequences = torch.cat([prompt, responses], dim=1)
        expected = postprocess.finalize_input_ids(sequences.clone(), prompt.shape[1], lengths, width, pad)
        ids = postprocess.finalize_input_ids(sequences, prompt.shape[1], lengths, width, pad, padded=True)
        assert ids.is_contiguous() and torch.equal(ids, expected)


@settings(max_examples=200, deadline=None)
@given(raw_batches(), st.integers(1, 3), st.integers(0, 3))
def test_the_mask_allocated_at_expansion_equals_reference(case, n, spare):
    """The batch's mask allocated by ``expand_prompts`` (``spare`` columns wider than the batch, as under
    ``response_width='longest'``) and its response columns written by ``attention_mask``: the reference's mask, a
    contiguous tensor, the prompt mask the strategies saw unchanged."""
    prompt, mask, responses, pad, eos_ids = case
    ids, batch_mask = postprocess.expand_prompts(prompt, mask, n, responses.shape[1] + spare)
    responses = responses.repeat_interleave(n, dim=0)
    lengths = postprocess.response_lengths(responses, torch.tensor(eos_ids))
    width = int(lengths.max())
    _, ref_mask = reference_postprocess(torch.cat([ids, responses], dim=1), ids,
                                        mask.repeat_interleave(n, dim=0), eos_ids, pad)
    seen = batch_mask[:, :prompt.shape[1]]
    assert torch.equal(seen, mask.repeat_interleave(n, dim=0))
    attention = postprocess.attention_mask(batch_mask, prompt.shape[1], lengths, width)
    assert attention.is_contiguous() and attention.dtype == mask.dtype
    assert torch.equal(attention, ref_mask)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=0, max_size=7, unique=True))
def test_eos_search_equals_isin(eos_ids):
    tokens = torch.arange(40).remainder(10).view(4, 10).flip(1)
    eos = torch.tensor(eos_ids, dtype=torch.int64)
    assert torch.equal(postprocess.is_eos(tokens, eos), torch.isin(tokens, eos))


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.integers(1, 4))
def test_expansion_is_repeat_interleave(batch, prompt_len, n):
    ids = torch.arange(batch * prompt_len).view(batch, prompt_len)
    mask = (ids % 3 != 0).long()
    out_ids, out_mask = postprocess.expand_prompts(ids, mask, n)
    for row in range(batch * n):
        assert torch.equal(out_ids[row], ids[row // n])
        assert torch.equal(out_mask[row], mask[row // n])


def test_generated_pad_before_eos_is_kept_and_masked_in():
    responses = torch.tensor([[0, 5, 2, 0, 0], [7, 7, 7, 7, 7]])
    lengths = postprocess.response_lengths(responses, torch.tensor([2]))
    assert lengths.tolist() == [3, 5]
    mask = postprocess.build_attention_mask(torch.ones(2, 1, dtype=torch.long), lengths, 5)
    assert mask[:, 1:].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
