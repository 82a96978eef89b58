"""Per-token divergences between student and teacher distributions, reduced over response tokens.

``generalized_jsd`` follows GKD (Agarwal et al., 2024): with ``M = beta * P_T + (1 - beta) * P_S``,
``JSD_beta = beta * KL(P_T || M) + (1 - beta) * KL(P_S || M)``; the endpoints are the two KLs the family
interpolates: ``beta = 0`` is forward KL ``KL(P_T || P_S)``, ``beta = 1`` is reverse KL ``KL(P_S || P_T)``.
With a top-k teacher cache (the teacher's k most likely tokens and their log-probabilities), ``top_k_rest`` says
what becomes of the rest of the vocabulary: ``renormalize`` (DeepSpeed's definition) renormalizes both
distributions over the k tokens; ``tail`` keeps the k tokens' probabilities as they are and adds one bucket holding
each side's mass outside them (verl's and TRL's top-k distillation), so the divergence is over k + 1 entries. A
``pointwise_clip`` caps each vocabulary entry's contribution before the per-token sum, as DeepSpeed's
``generalized_jsd_loss`` defines it.

``generalized_jsd_loss`` is DeepSpeed's function of that name (same arguments, defaults, errors and
``JSDLossOutput``), computed here: chunked over positions with each chunk recomputed in backward, and in
float32 at least (DeepSpeed computes in the logits' dtype).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

import torch
import torch.nn.functional as F
from deepspeed.runtime.rollout.opsd import JSDLossOutput
from torch.utils.checkpoint import checkpoint

from opsd_rollout import checks

TeacherLogits: TypeAlias = "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"
"""The teacher's side of a divergence: logits [..., V], or a top-k pair (values [..., k], indices [..., k])."""
TeacherChunk: TypeAlias = "Callable[[int, int], TeacherLogits]"
"""``teacher_chunk(start, stop)``: the teacher's cache for window positions ``start:stop``."""

LOSSES = ("forward_kl", "reverse_kl", "jsd", "sampled_reverse_kl")
ESTIMATORS = ("k1", "k3")
TOP_K_RESTS = ("renormalize", "tail")
WHOLE_DISTRIBUTION = ("forward_kl", "reverse_kl", "jsd")
"""The losses that need the teacher's distribution (a ``full`` or ``topk`` cache), not one token's probability."""


@dataclass(frozen=True, kw_only=True)
class DivergenceConfig:
    """Which divergence, and how."""

    loss: str = "jsd"
    """``forward_kl`` (teacher to student), ``reverse_kl`` (student to teacher) or ``jsd`` (with ``beta``), over
    the teacher's distribution; or ``sampled_reverse_kl``: the reverse KL of the sampled tokens alone (the
    teacher's log-probability of each, a ``sampled`` teacher cache), trained as an on-policy policy gradient
    (``opsd/sampled.py``). From a random-weight student ``jsd`` and ``sampled_reverse_kl`` learnt nothing on the
    built-in task where ``forward_kl`` did; from a warm start ``jsd`` and ``reverse_kl`` over the teacher's top 64
    with the tail led (docs/TRAINING.md, "Which loss")."""
    estimator: str = "k1"
    """``sampled_reverse_kl``'s per-token estimate of KL(student || teacher) from r = log p_s(y) - log p_t(y):
    ``k1`` = r, or ``k3`` = exp(-r) - 1 + r (verl's low-variance estimator, never negative)."""
    beta: float = 0.5
    """Generalized JSD interpolation: 0 is forward KL, 1 is reverse KL."""
    temperature: float = 1.0
    """Both distributions are softened by this temperature."""
    chunk_size: int = 128
    """Sequence positions per chunk; each chunk's intermediates are recomputed in backward, not kept."""
    pointwise_clip: float | None = None
    """Cap on each vocabulary entry's contribution to a token's divergence, applied before the sum over the
    vocabulary (DeepSpeed's ``pointwise_clip``); clipped entries pass no gradient. ``None``: no cap."""
    top_k_rest: str = "renormalize"
    """With a top-k teacher cache, the vocabulary outside the teacher's k tokens: ``renormalize`` drops it and
    renormalizes both distributions over the k tokens (DeepSpeed's ``teacher_top_k``); ``tail`` keeps it as one
    bucket on each side, the mass the distribution puts outside the k tokens (verl, TRL), which needs the teacher's
    log-probabilities at temperature 1 (what a top-k cache and a served teacher hold), so temperature 1."""
    fused: bool = True
    """``opsd_step``: the student's LM head computed inside the loss, a chunk of response tokens at a time, with
    its gradients in the same pass (``opsd/fused.py``): the logits [N, R, V] are never whole. ``False``: the
    model's logits, then ``chunked_divergence`` (the reference). A student whose head cannot be fused (not a
    plain ``nn.Linear``, or a forward without ``logits_to_keep``) runs the reference, with a warning."""
    fused_chunk_tokens: int | None = None
    """Response tokens per chunk of the fused loss; ``None`` sizes chunks so that one float32 intermediate of a
    chunk (``[tokens, V]``, or the gathered top-k head rows) takes about 32 MiB."""

    def __post_init__(self) -> None:
        checks.choice("loss", self.loss, LOSSES)
        checks.choice("estimator", self.estimator, ESTIMATORS)  # sampled_reverse_kl's per-token KL estimate
        if self.loss == "sampled_reverse_kl" and self.temperature != 1.0:
            raise ValueError(f"sampled_reverse_kl compares the sampled tokens' log-probabilities at temperature 1; "
                             f"got temperature {self.temperature!r}")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1]; got {self.beta!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be positive; got {self.temperature!r}")
        checks.choice("top_k_rest", self.top_k_rest, TOP_K_RESTS)
        if self.top_k_rest == "tail" and self.temperature != 1.0:
            raise ValueError(f"top_k_rest='tail' needs temperature 1: the teacher's mass outside its top-k is known "
                             f"at temperature 1 only (a top-k cache, a served teacher's log-probabilities); got "
                             f"temperature {self.temperature!r} (top_k_rest='renormalize' softens both distributions)")
        checks.integer("chunk_size", self.chunk_size)
        checks.integer("fused_chunk_tokens", self.fused_chunk_tokens, optional=True)
        clip = self.pointwise_clip
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip >= 0):
            raise ValueError(f"pointwise_clip must be non-negative when specified (a number >= 0 or None); "
                             f"got {clip!r}")

    @property
    def effective_beta(self) -> float:
        return {"forward_kl": 0.0, "reverse_kl": 1.0}.get(self.loss, self.beta)


def pointwise_jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """student_logp, teacher_logp: [..., V] log-probabilities. Returns each vocabulary entry's contribution to the
    generalized JSD [..., V] (what ``pointwise_clip`` caps)."""
    if beta == 0.0:
        return teacher_logp.exp() * (teacher_logp - student_logp)
    if beta == 1.0:
        return student_logp.exp() * (student_logp - teacher_logp)
    mixture = torch.logaddexp(teacher_logp + math.log(beta), student_logp + math.log1p(-beta))
    return (beta * teacher_logp.exp() * (teacher_logp - mixture)
            + (1 - beta) * student_logp.exp() * (student_logp - mixture))


def generalized_jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float,
                    pointwise_clip: float | None = None) -> torch.Tensor:
    """student_logp, teacher_logp: [..., V] log-probabilities. Returns the divergence per position [...], each
    vocabulary entry's contribution capped at ``pointwise_clip`` first when it is given."""
    pointwise = pointwise_jsd(student_logp, teacher_logp, beta)
    if pointwise_clip is not None:
        pointwise = pointwise.clamp(max=pointwise_clip)
    return pointwise.sum(-1)


LOG_TINY = math.log(torch.finfo(torch.float32).tiny)
"""The floor of a tail bucket's log-probability: an empty tail (log 0) would turn 0 * (-inf) into NaN."""


def tail_logp(top_logp: torch.Tensor) -> torch.Tensor:
    """[..., k] log-probabilities of k tokens -> [..., 1] the log of the mass outside them, floored at ``LOG_TINY``
    (rounding can make the k tokens' mass reach 1)."""
    mass = torch.logsumexp(top_logp, dim=-1, keepdim=True).clamp(max=0.0)
    return torch.log(-torch.expm1(mass)).clamp(min=LOG_TINY)


def student_tail_logp(student: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """student [..., V] logits, indices [..., k] (k < V, distinct) -> the student's log-probabilities at the k
    tokens [..., k] and of the rest of the vocabulary [..., 1] (floored at ``LOG_TINY``), differentiable."""
    normalizer = torch.logsumexp(student, dim=-1, keepdim=True)
    top = student.gather(-1, indices) - normalizer
    rest = torch.logsumexp(student.scatter(-1, indices, float("-inf")), dim=-1, keepdim=True) - normalizer
    return top, rest.clamp(min=LOG_TINY)


def top_k_buckets(student: torch.Tensor, values: torch.Tensor, indices: torch.Tensor,
                  rest: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The two distributions a top-k cache compares, as log-probabilities over the same entries: student logits
    [..., V] (already over the temperature), the teacher's k values and indices [..., k] -> (student, teacher)
    [..., k] renormalized (``rest="renormalize"``, or when k covers the vocabulary) or [..., k + 1] with the tail
    bucket last (``rest="tail"``; ``values`` then are log-probabilities)."""
    indices = indices.long()
    if rest == "renormalize" or indices.shape[-1] >= student.shape[-1]:
        return F.log_softmax(student.gather(-1, indices), dim=-1), F.log_softmax(values, dim=-1)
    top, tail = student_tail_logp(student, indices)
    return torch.cat([top, tail], dim=-1), torch.cat([values, tail_logp(values)], dim=-1)


def token_divergence(student_logits: torch.Tensor, teacher: TeacherLogits,
                     config: DivergenceConfig) -> torch.Tensor:
    """student_logits: [..., V]; teacher: logits [..., V] or a top-k pair (values [..., k], indices [..., k]: logits
    or log-probabilities with ``top_k_rest="renormalize"``, log-probabilities with ``"tail"``).
    Returns the per-position divergence [...] in float32 (float64 for float64 logits)."""
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    student = student_logits.to(dtype) / config.temperature
    if isinstance(teacher, tuple):
        values, indices = teacher
        student_logp, teacher_logp = top_k_buckets(student, values.to(dtype) / config.temperature, indices,
                                                   config.top_k_rest)
    else:
        student_logp = F.log_softmax(student, dim=-1)
        teacher_logp = F.log_softmax(teacher.to(dtype) / config.temperature, dim=-1)
    return generalized_jsd(student_logp, teacher_logp, config.effective_beta, config.pointwise_clip)


def _chunk_sum(student_logits: torch.Tensor, mask: torch.Tensor, teacher_chunk: TeacherChunk, start: int, stop: int,
               config: DivergenceConfig) -> torch.Tensor:
    # the teacher's chunk is fetched here, inside the checkpointed function: backward fetches it again
    # instead of activation checkpointing keeping every chunk's device copy alive until backward
    return (token_divergence(student_logits, teacher_chunk(start, stop), config) * mask).sum()


def chunked_divergence(student_logits: torch.Tensor, teacher_chunk: TeacherChunk, mask: torch.Tensor,
                       config: DivergenceConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum and count of the divergence over valid positions, computed ``config.chunk_size`` positions at a time.

    student_logits: [N, R, V] (with grad); ``teacher_chunk(start, stop)`` returns the teacher's cache for
    window positions ``start:stop`` on the student's device (logits [N, c, V] or a top-k pair); mask: [N, R].
    With grad, each chunk's intermediates (and its teacher chunk) are recomputed in backward, not kept.
    Returns ``(sum, count)`` separately so ranks can all-reduce both before dividing.
    """
    dtype = torch.promote_types(student_logits.dtype, torch.float32)  # what token_divergence computes in
    total = student_logits.new_zeros((), dtype=dtype)
    mask = mask.to(dtype)
    for start in range(0, student_logits.shape[1], config.chunk_size):
        stop = min(start + config.chunk_size, student_logits.shape[1])
        args = (student_logits[:, start:stop], mask[:, start:stop], teacher_chunk, start, stop, config)
        if student_logits.requires_grad:
            total = total + checkpoint(_chunk_sum, *args, use_reentrant=False)
        else:
            total = total + _chunk_sum(*args)
    return total, mask.sum()


def generalized_jsd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, response_mask: torch.Tensor,
                         beta: float = 0.5, temperature: float = 1.0, teacher_top_k: int | None = None,
                         pointwise_clip: float | None = None) -> JSDLossOutput:
    """DeepSpeed's ``generalized_jsd_loss``, on our divergence: the mean generalized JSD over valid tokens.

    student_logits, teacher_logits: [N, T, V] (e.g. ``ResponseTokenBatch.select_causal_logits``);
    response_mask: [N, T], true on the tokens to train on. ``beta=0`` is forward KL (teacher to student),
    ``beta=1`` reverse KL. A positive ``teacher_top_k`` renormalizes both distributions over the teacher's k
    most likely entries; ``pointwise_clip`` caps each entry's contribution before the per-token sum. Returns
    ``JSDLossOutput(loss, loss_sum, valid_token_count)``: ``loss_sum / max(count, 1)``, with the sum and count
    kept for reduction across ranks. The errors are DeepSpeed's, with the value that caused them.
    """
    if student_logits.dim() != 3 or student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student_logits and teacher_logits must have matching 3-D shapes; got "
                         f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}")
    if response_mask.shape != student_logits.shape[:2]:
        raise ValueError(f"response_mask shape must match logits batch and sequence dimensions "
                         f"{tuple(student_logits.shape[:2])}; got {tuple(response_mask.shape)}")
    # beta, temperature and pointwise_clip are checked by the config, with DeepSpeed's messages
    config = DivergenceConfig(loss="jsd", beta=beta, temperature=temperature, pointwise_clip=pointwise_clip)
    vocab = student_logits.shape[-1]
    if teacher_top_k is not None and teacher_top_k <= 0:
        raise ValueError(f"teacher_top_k must be positive when specified; got {teacher_top_k!r}")
    if teacher_top_k is not None and teacher_top_k > vocab:
        raise ValueError(f"teacher_top_k must not exceed the vocabulary size {vocab}; got {teacher_top_k!r}")
    # the top k before temperature scaling: the order it keeps
    top = None if teacher_top_k is None else torch.topk(teacher_logits, teacher_top_k, dim=-1)

    def teacher_chunk(start: int, stop: int) -> TeacherLogits:
        if top is None:
            return teacher_logits[:, start:stop]
        return top.values[:, start:stop], top.indices[:, start:stop]
    # the mask is used as given, as DeepSpeed does: a 0/1 mask selects tokens, other values weigh them
    loss_sum, count = chunked_divergence(student_logits, teacher_chunk, response_mask, config)
    valid_token_count = count.to(torch.long)
    return JSDLossOutput(loss=loss_sum / valid_token_count.clamp_min(1), loss_sum=loss_sum,
                         valid_token_count=valid_token_count)
