"""Per-token divergences between student and teacher distributions, reduced over response tokens.

``generalized_jsd`` follows GKD (Agarwal et al., 2024): with ``M = beta * P_T + (1 - beta) * P_S``,
``JSD_beta = beta * KL(P_T || M) + (1 - beta) * KL(P_S || M)``; the endpoints are the two KLs the family
interpolates: ``beta = 0`` is forward KL ``KL(P_T || P_S)``, ``beta = 1`` is reverse KL ``KL(P_S || P_T)``.
With a top-k teacher cache, both distributions are renormalized over the teacher's k tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LOSSES = ("forward_kl", "reverse_kl", "jsd")


@dataclass(frozen=True, kw_only=True)
class DivergenceConfig:
    """Which divergence, and how."""

    loss: str = "jsd"
    """``forward_kl`` (teacher to student), ``reverse_kl`` (student to teacher) or ``jsd`` (with ``beta``)."""
    beta: float = 0.5
    """Generalized JSD interpolation: 0 is forward KL, 1 is reverse KL."""
    temperature: float = 1.0
    """Both distributions are softened by this temperature."""
    chunk_size: int = 128
    """Sequence positions per chunk; each chunk's intermediates are recomputed in backward, not kept."""

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {list(LOSSES)}; got {self.loss!r}")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1]; got {self.beta!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0; got {self.temperature!r}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1; got {self.chunk_size!r}")

    @property
    def effective_beta(self) -> float:
        return {"forward_kl": 0.0, "reverse_kl": 1.0}.get(self.loss, self.beta)


def generalized_jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """student_logp, teacher_logp: [..., V] log-probabilities. Returns the divergence per position [...]."""
    if beta == 0.0:
        return (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)
    if beta == 1.0:
        return (student_logp.exp() * (student_logp - teacher_logp)).sum(-1)
    mixture = torch.logsumexp(torch.stack([teacher_logp + math.log(beta), student_logp + math.log(1 - beta)]), dim=0)
    kl_teacher = (teacher_logp.exp() * (teacher_logp - mixture)).sum(-1)
    kl_student = (student_logp.exp() * (student_logp - mixture)).sum(-1)
    return beta * kl_teacher + (1 - beta) * kl_student


def token_divergence(student_logits: torch.Tensor, teacher: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                     config: DivergenceConfig) -> torch.Tensor:
    """student_logits: [..., V]; teacher: logits [..., V] or a top-k pair (values [..., k], indices [..., k]).
    Returns the per-position divergence [...] in float32."""
    student = student_logits.float() / config.temperature
    if isinstance(teacher, tuple):
        values, indices = teacher
        student = student.gather(-1, indices.long())  # the student restricted to the teacher's top-k support
        teacher_logits = values.float()
    else:
        teacher_logits = teacher.float()
    teacher_logp = F.log_softmax(teacher_logits / config.temperature, dim=-1)
    return generalized_jsd(F.log_softmax(student, dim=-1), teacher_logp, config.effective_beta)


def _chunk_sum(student_logits: torch.Tensor, mask: torch.Tensor, teacher_chunk, start: int, stop: int,
               config: DivergenceConfig) -> torch.Tensor:
    # the teacher's chunk is fetched here, inside the checkpointed function: backward fetches it again
    # instead of activation checkpointing keeping every chunk's device copy alive until backward
    return (token_divergence(student_logits, teacher_chunk(start, stop), config) * mask).sum()


def chunked_divergence(student_logits: torch.Tensor, teacher_chunk, mask: torch.Tensor,
                       config: DivergenceConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum and count of the divergence over valid positions, computed ``config.chunk_size`` positions at a time.

    student_logits: [N, R, V] (with grad); ``teacher_chunk(start, stop)`` returns the teacher's cache for
    window positions ``start:stop`` on the student's device (logits [N, c, V] or a top-k pair); mask: [N, R].
    With grad, each chunk's intermediates (and its teacher chunk) are recomputed in backward, not kept.
    Returns ``(sum, count)`` separately so ranks can all-reduce both before dividing.
    """
    total = student_logits.new_zeros((), dtype=torch.float32)
    mask = mask.to(torch.float32)
    for start in range(0, student_logits.shape[1], config.chunk_size):
        stop = min(start + config.chunk_size, student_logits.shape[1])
        args = (student_logits[:, start:stop], mask[:, start:stop], teacher_chunk, start, stop, config)
        if student_logits.requires_grad:
            total = total + checkpoint(_chunk_sum, *args, use_reentrant=False)
        else:
            total = total + _chunk_sum(*args)
    return total, mask.sum()
