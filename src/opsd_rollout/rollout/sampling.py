"""Token selection without host synchronization: argmax for greedy; for sampling, temperature, top-k and
top-p filtering then an exponential-race draw from a seeded generator (``argmax(p / E)`` with
``E ~ Exp(1)`` picks token ``i`` with probability ``p_i``), which needs no ``multinomial`` and no sync."""

from __future__ import annotations

import torch

from opsd_rollout.rollout.validation import RolloutPlan


def filter_logits(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [N, V] -> temperature-scaled logits with filtered tokens at ``-inf`` (float32).

    top-k keeps the k largest (``top_k <= 0`` keeps all); top-p keeps the smallest set of most likely
    tokens whose probability reaches ``top_p`` (always at least one), as transformers' warpers do.
    """
    logits = logits.float() / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly more likely tokens
        remove = mass_before >= top_p
        remove[:, 0] = False
        logits = logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    return logits


def sample(logits: torch.Tensor, plan: RolloutPlan, generator: torch.Generator | None) -> torch.Tensor:
    """logits: [N, V] -> next tokens [N] (int64), on the logits' device, without a host sync."""
    if plan.greedy:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, temperature=plan.temperature, top_k=plan.top_k, top_p=plan.top_p).softmax(dim=-1)
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race).argmax(dim=-1)
