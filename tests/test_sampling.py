"""Sampling primitives: the inverse-CDF draw, and top-k/top-p filtering equal to transformers' warpers on
both paths (k candidates on CPU, whole vocabulary otherwise), ties with the k-th logit included."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from opsd_rollout.rollout.sampling import draw, sample


def assert_follows(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Support and chi-square goodness of fit (rare cells pooled) of sample counts against probs."""
    assert counts[probs == 0].sum() == 0, "a zero-probability index was drawn"
    assert (counts > 0).sum() == (probs > 0).sum(), "not every kept index was drawn"
    expected = probs.double() / probs.sum() * counts.sum()
    big = expected >= 5
    observed = np.append(counts[big].numpy(), counts[~big].sum().item())
    wanted = np.append(expected[big].numpy(), expected[~big].sum().item())
    keep = wanted > 0
    assert chisquare(observed[keep], wanted[keep] * observed[keep].sum() / wanted[keep].sum()).pvalue > 0.001


def test_draw_follows_unnormalized_probabilities_and_never_draws_a_zero():
    probs = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 0.0])  # zeros first, inside and last
    generator = torch.Generator().manual_seed(0)
    picks = draw(probs.expand(20000, -1), generator)
    assert_follows(torch.bincount(picks, minlength=probs.numel()).double(), probs)
    one = torch.tensor([[0.0, 0.0, 1e-30, 0.0]])  # a single tiny mass still wins every draw
    assert draw(one.expand(100, -1), generator).eq(2).all()


def transformers_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(dim=-1)[0]


TIED = slice(3, 9)


def pool_ties(values: torch.Tensor) -> torch.Tensor:
    """Which tied tokens top-p keeps is up to the sort's order among ties: compare the tied group's total."""
    return torch.cat([values[:TIED.start], values[TIED].sum().reshape(1), values[TIED.stop:]])


@pytest.mark.parametrize("top_k,top_p", [(4, 1.0), (4, 0.99), (0, 0.9), (8, 0.8), (2, 1.0), (9, 0.9)])
def test_sampling_equals_transformers_warpers_with_ties_at_the_kth_logit(top_k, top_p):
    """Logits 5, 4, 3 and six tied at 2 (the 4th largest), then lower ones: transformers' top-k keeps all
    six ties, so must we (the CPU candidate path hands such rows to the whole-vocabulary path; with k = 9
    the ties are inside the candidates and top-p cuts through them)."""
    logits = torch.tensor([[5.0, 4.0, 3.0] + [2.0] * 6 + [1.0, 0.5, 0.0, -1.0] * 4])
    temperature = 0.9
    probs = transformers_probs(logits, temperature, top_k, top_p)
    plan = SimpleNamespace(greedy=False, temperature=temperature, top_k=top_k, top_p=top_p)
    generator = torch.Generator().manual_seed(5)
    picks = torch.cat([sample(logits.expand(2000, -1), plan, generator) for _ in range(5)])
    counts = torch.bincount(picks, minlength=logits.shape[1]).double()
    assert (counts[TIED] > 0).sum() == (probs[TIED] > 0).sum(), "a different number of tied tokens kept"
    assert_follows(pool_ties(counts), pool_ties(probs))


def test_candidate_path_equals_transformers_without_ties():
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(1)) * 3
    for top_k, top_p in [(10, 1.0), (40, 0.9)]:
        probs = transformers_probs(logits, 1.2, top_k, top_p)
        plan = SimpleNamespace(greedy=False, temperature=1.2, top_k=top_k, top_p=top_p)
        picks = sample(logits.expand(10000, -1), plan, torch.Generator().manual_seed(top_k))
        assert_follows(torch.bincount(picks, minlength=logits.shape[1]).double(), probs)
