"""DeepSpeed's OPSD loss and targets on ours: ``generalized_jsd_loss`` gives DeepSpeed's value, gradient and errors
for every beta / temperature / teacher top-k / pointwise clip; ``pointwise_clip`` in ``DivergenceConfig`` caps
what DeepSpeed caps; ``ResponseTokenBatch`` converts to and from ``ResponseTargets`` exactly."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from deepspeed.runtime.rollout import generalized_jsd_loss as deepspeed_loss

from conftest import chain_table, left_padded, make_tokenizer, transition_model
from opsd_rollout import (HybridEngineRollout, JSDLossOutput, ResponseTokenBatch, RolloutBatch, SamplingConfig,
                          generalized_jsd_loss)
from opsd_rollout.modeling import position_ids
from opsd_rollout.opsd import (DivergenceConfig, ResponseTargets, TeacherCacheBuffers, TeacherCacheConfig,
                               build_teacher_cache, chunked_divergence, pointwise_jsd, response_targets,
                               token_divergence)

VOCAB = 11


def logits_and_mask(seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(3, 5, VOCAB, generator=g, dtype=dtype) * 2
    teacher = torch.randn(3, 5, VOCAB, generator=g, dtype=dtype) * 2
    mask = torch.rand(3, 5, generator=g) > 0.3
    return student, teacher, mask


COMBINATIONS = list(itertools.product([0.0, 0.25, 0.5, 1.0], [0.5, 1.0, 2.0], [None, 1, 4, VOCAB],
                                      [None, 0.0, 0.03, 100.0]))


@pytest.mark.parametrize("beta,temperature,top_k,clip", COMBINATIONS)
def test_every_combination_gives_deepspeeds_value_and_gradient(beta, temperature, top_k, clip):
    student, teacher, mask = logits_and_mask(int(beta * 8 + temperature * 4) + (top_k or 0))
    kwargs = dict(beta=beta, temperature=temperature, teacher_top_k=top_k, pointwise_clip=clip)
    ours_student = student.clone().requires_grad_()
    theirs_student = student.clone().requires_grad_()
    ours = generalized_jsd_loss(ours_student, teacher, mask, **kwargs)
    theirs = deepspeed_loss(theirs_student, teacher, mask, **kwargs)
    assert isinstance(ours, JSDLossOutput)
    assert ours.valid_token_count.dtype == torch.long and int(ours.valid_token_count) == int(mask.sum())
    torch.testing.assert_close(ours.loss_sum, theirs.loss_sum, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-9, atol=1e-12)
    ours.loss.backward()
    theirs.loss.backward()
    torch.testing.assert_close(ours_student.grad, theirs_student.grad, rtol=1e-7, atol=1e-12)


def test_the_clip_caps_each_vocabulary_entry_before_the_token_sum():
    """Reference values from the definition: the clipped divergence is the sum of min(entry, clip), so it
    lies between the unclipped value and V x clip, and a clip above every entry changes nothing."""
    student, teacher, _ = logits_and_mask(3)
    student_logp, teacher_logp = student.log_softmax(-1), teacher.log_softmax(-1)
    entries = pointwise_jsd(student_logp, teacher_logp, 0.4)
    full = token_divergence(student, teacher, DivergenceConfig(beta=0.4))
    torch.testing.assert_close(full, entries.sum(-1))
    for clip in (0.0, 0.01, 0.05):
        clipped = token_divergence(student, teacher, DivergenceConfig(beta=0.4, pointwise_clip=clip))
        torch.testing.assert_close(clipped, entries.clamp(max=clip).sum(-1))
        assert (clipped <= full + 1e-12).all() and (clipped < full - 1e-6).any(), "this clip bites"
        assert (clipped <= VOCAB * clip + 1e-12).all()
    above = token_divergence(student, teacher, DivergenceConfig(beta=0.4, pointwise_clip=float(entries.max())))
    torch.testing.assert_close(above, full)


@pytest.mark.parametrize("clip", [None, 0.02])
def test_chunked_divergence_over_a_top_k_cache_with_a_clip_is_deepspeeds_top_k_loss(clip):
    """The OPSD step's path (top-k host cache, chunks recomputed in backward) with the clip from the config."""
    student, teacher, mask = logits_and_mask(5, torch.float32)
    top = torch.topk(teacher, 4, dim=-1)
    student = student.requires_grad_()
    total, count = chunked_divergence(
        student, lambda s, e: (top.values[:, s:e], top.indices[:, s:e]), mask,
        DivergenceConfig(loss="jsd", beta=0.3, temperature=1.5, chunk_size=2, pointwise_clip=clip))
    theirs = deepspeed_loss(student.detach().double(), teacher.double(), mask, beta=0.3, temperature=1.5,
                            teacher_top_k=4, pointwise_clip=clip)
    torch.testing.assert_close(total.double(), theirs.loss_sum, rtol=1e-5, atol=1e-6)
    assert int(count) == int(theirs.valid_token_count)


def test_defaults_are_deepspeeds():
    student, teacher, mask = logits_and_mask(7)
    torch.testing.assert_close(generalized_jsd_loss(student, teacher, mask).loss,
                               deepspeed_loss(student, teacher, mask).loss)
    assert DivergenceConfig().pointwise_clip is None


def test_an_empty_mask_gives_zero_and_a_count_of_zero():
    student, teacher, mask = logits_and_mask(8)
    out = generalized_jsd_loss(student, teacher, torch.zeros_like(mask))
    assert int(out.valid_token_count) == 0 and float(out.loss) == 0.0 and float(out.loss_sum) == 0.0


BAD = [
    ("must have matching 3-D shapes", lambda s, t, m: ((s, t[:, :4], m[:, :4]), {})),
    ("must have matching 3-D shapes", lambda s, t, m: ((s[0], t[0], m[0]), {})),
    ("response_mask shape must match", lambda s, t, m: ((s, t, m[:, :4]), {})),
    ("beta must be in \\[0, 1\\]", lambda s, t, m: ((s, t, m), {"beta": 1.5})),
    ("beta must be in \\[0, 1\\]", lambda s, t, m: ((s, t, m), {"beta": -0.1})),
    ("temperature must be positive", lambda s, t, m: ((s, t, m), {"temperature": 0.0})),
    ("teacher_top_k must be positive when specified", lambda s, t, m: ((s, t, m), {"teacher_top_k": 0})),
    ("teacher_top_k must not exceed the vocabulary size", lambda s, t, m: ((s, t, m), {"teacher_top_k": VOCAB + 1})),
    ("pointwise_clip must be non-negative when specified", lambda s, t, m: ((s, t, m), {"pointwise_clip": -0.5})),
]


@pytest.mark.parametrize("message,make", BAD, ids=[f"{m[:24]}{i}" for i, (m, _) in enumerate(BAD)])
def test_errors_are_deepspeeds(message, make):
    args, kwargs = make(*logits_and_mask(9))
    with pytest.raises(ValueError, match=message):
        deepspeed_loss(*args, **kwargs)  # the message is DeepSpeed's own
    with pytest.raises(ValueError, match=message):
        generalized_jsd_loss(*args, **kwargs)


@pytest.mark.parametrize("clip", [-1.0, float("nan"), True, "0.1"])
def test_divergence_config_refuses_a_bad_clip(clip):
    with pytest.raises(ValueError, match="pointwise_clip must be non-negative"):
        DivergenceConfig(pointwise_clip=clip)


def rollout_with_eos():
    """Rows 0-1 stop at EOS after two tokens, rows 2-3 run to max_new_tokens; rows 2-3's prompt is padded."""
    model = transition_model(chain_table(16, {6: 2}))
    return HybridEngineRollout(model, make_tokenizer(0, 2)).generate(
        left_padded([[4, 5], [9]], 0), SamplingConfig(max_new_tokens=5, n_samples_per_prompt=2, temperature=0))


def test_our_targets_convert_to_deepspeeds_response_token_batch_and_back():
    batch = rollout_with_eos()
    ours = response_targets(batch)
    theirs = ResponseTokenBatch.from_rollout(batch)
    converted = ours.to_token_batch()
    for field in dataclasses.fields(ResponseTokenBatch):
        assert torch.equal(getattr(converted, field.name), getattr(theirs, field.name)), field.name
    back = ResponseTargets.from_token_batch(theirs)
    assert back.prompt_length == ours.prompt_length and back.window == ours.window
    assert torch.equal(back.labels, ours.labels) and torch.equal(back.mask, ours.mask)
    assert response_targets(theirs).tokens == ours.tokens == int(theirs.response_mask.sum())
    assert response_targets(ours) is ours


def test_a_response_token_batch_with_rows_starting_apart_keeps_its_mask():
    """DeepSpeed's batches may start rows' responses at different columns; ours start the window at the
    earliest and mask the rest, exactly as DeepSpeed's mask does."""
    rollout = RolloutBatch(input_ids=torch.tensor([[0, 11, 12, 21, 2, 0], [13, 14, 15, 22, 23, 2]]),
                           attention_mask=torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]),
                           response_start_idx=torch.tensor([3, 4]))
    theirs = ResponseTokenBatch.from_rollout(rollout)
    ours = ResponseTargets.from_token_batch(theirs)
    assert ours.prompt_length == 3 and ours.window == slice(2, 5)
    assert ours.labels.tolist() == [[21, 2, 0], [22, 23, 2]]
    assert ours.mask.tolist() == [[True, True, False], [False, True, True]]
    assert not theirs.response_mask[:, :2].any(), "nothing is trained on before the window"
    with pytest.raises(ValueError, match="ResponseTokenBatch.from_rollout"):
        response_targets(rollout)
    assert torch.equal(ours.to_token_batch().response_mask, theirs.response_mask)


def test_teacher_cache_and_loss_from_deepspeeds_targets_equal_ours(tiny_models):
    """build_teacher_cache takes DeepSpeed's ResponseTokenBatch; the OPSD loss over our window then equals
    DeepSpeed's generalized_jsd_loss over its causal logits and mask."""
    teacher, student = tiny_models["gpt2-tiny"], tiny_models["llama-tiny"]
    request = left_padded([[40, 41, 42], [50]], 0)
    batch = HybridEngineRollout(student, make_tokenizer(0, 2)).generate(
        request, SamplingConfig(max_new_tokens=6, n_samples_per_prompt=2, temperature=0))
    ours, theirs = response_targets(batch), ResponseTokenBatch.from_rollout(batch)
    config = TeacherCacheConfig(mode="topk", top_k=7, chunk_size=3)
    from_ours = build_teacher_cache(teacher, ours, config, buffers=TeacherCacheBuffers())
    from_theirs = build_teacher_cache(teacher, theirs, config, buffers=TeacherCacheBuffers())
    torch.testing.assert_close(from_ours.values, from_theirs.values)
    assert torch.equal(from_ours.indices, from_theirs.indices)
    inputs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                  position_ids=position_ids(batch.attention_mask))  # the positions the teacher cache uses
    with torch.no_grad():
        student_logits, teacher_logits = student(**inputs).logits, teacher(**inputs).logits
    total, count = chunked_divergence(student_logits[:, ours.window],
                                      lambda s, e: from_ours.chunk(s, e, torch.device("cpu")), ours.mask,
                                      DivergenceConfig(beta=0.5, pointwise_clip=0.1))
    expected = deepspeed_loss(theirs.select_causal_logits(student_logits),
                              theirs.select_causal_logits(teacher_logits), theirs.response_mask, beta=0.5,
                              teacher_top_k=7, pointwise_clip=0.1)
    torch.testing.assert_close(total, expected.loss_sum, rtol=1e-5, atol=1e-5)
    assert int(count) == int(expected.valid_token_count) == ours.tokens
