"""Token selection without host synchronization: argmax for greedy; for sampling, temperature, top-k and
top-p filtering as transformers' warpers do, then an inverse-CDF draw with one uniform number per row (from
``counter_rng``: a function of the seed, the row and the step, so scheduling never changes a token), not one
per vocabulary entry, and no ``multinomial``.

On CPU with top-k, filtering and the draw run over the k candidates only, found in one pass over the raw logits
(scaling, sorting or counting a 150k vocabulary costs more than a small model's forward there). Logits tied
with the k-th stay candidates, as transformers keeps them; whether there are any is one host read (free on
CPU). On CUDA the whole-vocabulary path always runs (sorting is cheap there, and a host read is not). Which
path runs depends on the sampling knobs and the device, never on the batch, and each row's token depends on its
own logits and uniform only.
"""

from __future__ import annotations

import torch

from opsd_rollout.rollout.validation import RolloutPlan


def sort_descending(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (values, positions), descending, ties in ascending position: where top-p cuts through tied
    tokens, which of them stay is then fixed (transformers leaves it to an unstable sort)."""
    return torch.sort(logits, dim=-1, descending=True, stable=True)


def top_p_removed(sorted_logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """sorted_logits: [N, K] descending -> bool [N, K], True for the tokens top-p removes: those whose more
    likely tokens already reach ``top_p`` (the most likely token always stays)."""
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly more likely tokens
    removed = mass_before >= top_p
    removed[:, 0] = False
    return removed


def filter_logits(logits: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [N, V] temperature-scaled, float32 -> the same with filtered tokens at ``-inf``.

    top-k keeps the k largest and every logit tied with the k-th (``top_k <= 0`` keeps all); top-p keeps the
    smallest set of most likely tokens whose probability reaches ``top_p`` (always at least one).
    """
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = sort_descending(logits)
        removed = top_p_removed(sorted_logits, top_p)
        logits = logits.masked_fill(removed.scatter(1, order, removed), float("-inf"))
    return logits


def precise_dtype(device: torch.device) -> torch.dtype:
    """The dtype of the draw's CDF and uniforms: float64, but float32 on MPS (which has no float64)."""
    return torch.float32 if device.type == "mps" else torch.float64


def draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """probs: [N, V], rows not necessarily normalized; uniform: [N, 1] in [0, 1) -> [N] indices, index i with
    probability ``probs[i] / probs.sum()`` over uniform draws; an index of zero probability is never drawn (a
    row of NaNs or zeros, which no distribution describes, still yields a valid index rather than V)."""
    cdf = probs.cumsum(dim=-1, dtype=precise_dtype(probs.device))
    total = cdf[:, -1:]
    u = uniform.to(cdf.dtype) * total
    u = torch.minimum(u, total.nextafter(torch.zeros_like(total)))  # strictly below the total after rounding
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def _top_k_candidates(logits: torch.Tensor, temperature: float,
                      top_k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """On CPU, each row's top-k temperature-scaled logits and every logit tied with its k-th (transformers keeps
    those too), with their ids: [N, W] each, W = k plus the most ties any row has, slots a row does not need at
    ``-inf``; in ``sort_descending``'s order. ``None`` on other devices or without top-k: the whole vocabulary is
    filtered then.

    One pass over the vocabulary: the k + 1 largest raw logits (dividing by a temperature > 0 keeps the order, so
    they are the largest scaled ones too), scaled alone. Only when the (k+1)-th then ties with the k-th (one host
    read, free on CPU), which fp32 logits almost never do, are the ties counted over the whole scaled
    vocabulary."""
    vocab = logits.shape[-1]
    if logits.device.type != "cpu" or not 0 < top_k < vocab:
        return None
    values, ids = torch.topk(logits, top_k + 1, dim=-1)  # descending
    values = values.float() / temperature
    if bool((values[:, top_k] >= values[:, top_k - 1]).any()):
        return _tied_candidates(logits.float() / temperature, top_k)
    return _descending_by_id(values[:, :top_k], ids[:, :top_k])


def _tied_candidates(scaled: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``_top_k_candidates`` when some row has logits tied with its k-th: counted over the scaled vocabulary."""
    values, ids = torch.topk(scaled, top_k, dim=-1, sorted=False)
    kth = values.min(dim=-1, keepdim=True).values
    width = int((scaled >= kth).sum(dim=-1).max())  # ties with the k-th: common with bf16/fp16 logits
    if width > top_k:
        values, ids = torch.topk(scaled, width, dim=-1, sorted=False)
        values = values.masked_fill(values < kth, float("-inf"))
    return _descending_by_id(values, ids)


def _descending_by_id(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates in ``sort_descending``'s order: by value, ties in ascending id, as on the whole vocabulary."""
    ids, by_id = ids.sort(dim=-1)
    values, order = sort_descending(values.gather(1, by_id))
    return values, ids.gather(1, order)


def sample(logits: torch.Tensor, plan: RolloutPlan, uniform: torch.Tensor | None) -> torch.Tensor:
    """logits: [N, V]; uniform: [N, 1], each row's draw (unused for greedy) -> next tokens [N] (int64), on the
    logits' device, without a host sync on CUDA."""
    if plan.greedy:
        return logits.argmax(dim=-1)
    candidates = _top_k_candidates(logits, plan.temperature, plan.top_k)
    if candidates is None:
        scaled = logits.float() / plan.temperature
        return draw(filter_logits(scaled, top_k=plan.top_k, top_p=plan.top_p).softmax(dim=-1), uniform)
    values, ids = candidates  # [N, k], descending
    if plan.top_p < 1.0:
        values = values.masked_fill(top_p_removed(values, plan.top_p), float("-inf"))
    return ids.gather(1, draw(values.softmax(dim=-1), uniform).unsqueeze(1)).squeeze(1)
