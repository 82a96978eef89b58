"""The top-k losses with the rest of the vocabulary as one tail bucket (``DivergenceConfig(top_k_rest="tail")``,
verl's and TRL's top-k distillation): the divergence over k + 1 buckets by the formula, the fused LM head's loss and
gradients equal to the reference's, the renormalized loss unchanged by a cache of log-probabilities instead of
logits, and a temperature other than 1 refused."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import jsd_by_hand
from opsd_rollout.opsd import DivergenceConfig, token_divergence
from test_fused_loss import assert_same, run

N, R, H, V = 3, 6, 8, 17


def buckets_by_hand(student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int):
    """The k + 1 bucket distributions, one position at a time, from the whole logits (float64)."""
    p = torch.softmax(student_logits.double(), -1)
    q = torch.softmax(teacher_logits.double(), -1)
    idx = torch.topk(teacher_logits, k, dim=-1).indices
    pk, qk = p.gather(-1, idx), q.gather(-1, idx)
    return (torch.cat([pk, 1 - pk.sum(-1, keepdim=True)], -1), torch.cat([qk, 1 - qk.sum(-1, keepdim=True)], -1))


def top_k_cache(teacher_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a top-k teacher cache (in-process or served) holds: the k tokens' log-probabilities and ids."""
    top = torch.topk(teacher_logits, k, dim=-1)
    return top.values - teacher_logits.logsumexp(-1, keepdim=True), top.indices


@pytest.mark.parametrize("loss,beta", [("forward_kl", 0.0), ("reverse_kl", 1.0), ("jsd", 0.3)])
@pytest.mark.parametrize("k", [1, 4, V - 1])
def test_tail_bucket_divergence_is_the_formula_over_k_plus_one_buckets(loss, beta, k):
    g = torch.Generator().manual_seed(k)
    student = torch.randn(2, 5, V, generator=g, dtype=torch.float64) * 2
    teacher = torch.randn(2, 5, V, generator=g, dtype=torch.float64) * 2
    ours = token_divergence(student, top_k_cache(teacher, k), DivergenceConfig(loss=loss, beta=beta, top_k_rest="tail"))
    p, q = buckets_by_hand(student, teacher, k)
    torch.testing.assert_close(ours, jsd_by_hand(p, q, beta), rtol=1e-6, atol=1e-9)
    assert (ours >= -1e-9).all()


def test_tail_bucket_differs_from_renormalizing_and_is_exact_when_k_covers_the_vocabulary():
    g = torch.Generator().manual_seed(5)
    student, teacher = torch.randn(4, V, generator=g, dtype=torch.float64), torch.randn(4, V, generator=g) * 3
    cache = top_k_cache(teacher, 3)
    tail = token_divergence(student, cache, DivergenceConfig(loss="forward_kl", top_k_rest="tail"))
    renormalized = token_divergence(student, cache, DivergenceConfig(loss="forward_kl"))
    assert not torch.allclose(tail, renormalized)
    whole = token_divergence(student, teacher.double(), DivergenceConfig(loss="forward_kl"))
    every = token_divergence(student, top_k_cache(teacher.double(), V), DivergenceConfig(loss="forward_kl",
                                                                                         top_k_rest="tail"))
    torch.testing.assert_close(every, whole)


def test_renormalized_top_k_is_the_same_over_log_probabilities_as_over_logits():
    """A top-k cache now holds log-probabilities; DeepSpeed's renormalized loss over it is unchanged."""
    g = torch.Generator().manual_seed(6)
    student, teacher = torch.randn(3, V, generator=g), torch.randn(3, V, generator=g) * 2
    top = torch.topk(teacher, 5, dim=-1)
    config = DivergenceConfig(loss="jsd", beta=0.4, temperature=0.7)
    torch.testing.assert_close(token_divergence(student, top_k_cache(teacher, 5), config),
                               token_divergence(student, (top.values, top.indices), config))


@pytest.mark.parametrize("loss,beta", [("forward_kl", 0.0), ("reverse_kl", 1.0), ("jsd", 0.5)])
@pytest.mark.parametrize("clip", [None, 0.02])
@pytest.mark.parametrize("scale,cap", [(1.0, None), (0.5, 3.0)])
def test_fused_tail_loss_and_gradients_equal_the_reference(loss, beta, clip, scale, cap):
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(N, R, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    cache = top_k_cache(torch.randn(N, R, V, generator=g, dtype=torch.float64) * 2, 4)
    mask = torch.rand(N, R, generator=g) > 0.25
    mask[1] = False
    config = DivergenceConfig(loss=loss, beta=beta, pointwise_clip=clip, top_k_rest="tail", fused_chunk_tokens=3)
    assert_same(run(hidden, weight, bias, cache, mask, config, fused=False, scale=scale, cap=cap),
                run(hidden, weight, bias, cache, mask, config, fused=True, scale=scale, cap=cap))


def test_tail_bucket_refuses_a_temperature_other_than_one():
    with pytest.raises(ValueError, match="top_k_rest='tail' needs temperature 1"):
        DivergenceConfig(loss="jsd", top_k_rest="tail", temperature=0.7)
    with pytest.raises(ValueError, match="top_k_rest"):
        DivergenceConfig(top_k_rest="drop")


def test_an_empty_tail_stays_finite():
    """Rounding can make the teacher's k tokens hold all its mass: the tail is floored, never NaN."""
    values = torch.tensor([[math.log(0.5), math.log(0.5)]])
    student = torch.tensor([[3.0, 1.0, -2.0, 0.5]], requires_grad=True)
    out = token_divergence(student, (values, torch.tensor([[0, 1]])), DivergenceConfig(loss="forward_kl",
                                                                                         top_k_rest="tail"))
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(student.grad).all()
