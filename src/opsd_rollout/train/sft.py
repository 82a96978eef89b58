"""One supervised step: the student's cross-entropy on reference text, the same parts and profile as an OPSD
step without its rollout and teacher (how ``--objective sft`` trains, and how a teacher that knows the corpus is
made)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from opsd_rollout.opsd.nonfinite import nonfinite_part
from opsd_rollout.opsd.student import engine_step, student_logits, token_mean
from opsd_rollout.opsd.step_profile import StepParts, StepProfile
from opsd_rollout.opsd.targets import TargetSource, response_targets
from opsd_rollout.profiling import Clock, StageRecorder

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    """logits: [N, R, V]; labels, mask: [N, R]. The summed cross-entropy over masked tokens (float32) and their
    count."""
    losses = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    return (losses * mask.flatten()).sum(), mask.sum()


def sft_step(student_engine: DeepSpeedEngine, batch: TargetSource, *, grad_norm: bool = False) -> StepProfile:
    """One step of ``student_engine`` (a DeepSpeed engine) on ``batch`` (a ``RolloutBatch`` whose responses are the
    references): cross-entropy over the response tokens, mean over every rank's tokens, backward, step
    (``grad_norm`` as ``opsd_step``'s)."""
    device = torch.device(student_engine.device)
    recorder = StageRecorder(Clock(device), time_forwards=False)
    parts = StepParts(recorder, device)
    with recorder.stage("total"):
        targets = response_targets(batch)
        logits = parts.run("student_forward", student_logits, student_engine, targets)
        total, count = parts.run("loss", cross_entropy_sum, logits, targets.labels, targets.mask.to(logits.device))
        loss, reported = token_mean(total, count)
        parts.run("backward", student_engine.backward, loss)
        norm = parts.run("optimizer", engine_step, student_engine, grad_norm=grad_norm)
    ms, starts = parts.times()
    value = float(reported)
    return StepProfile(
        rollout=None, eval_ms=0.0, train_ms=0.0, rollout_ms=0.0, teacher_forward_ms=0.0, cache_write_ms=0.0,
        student_forward_ms=ms["student_forward"], loss_ms=ms["loss"], backward_ms=ms["backward"],
        optimizer_ms=ms["optimizer"], total_ms=ms["total"], rollout_share=0.0, peak_memory_bytes=dict(parts.peaks),
        part_start_ms=starts, response_tokens=targets.tokens, loss=value,
        nonfinite=None if math.isfinite(value) else nonfinite_part([], logits, total),
        grad_norm=None if norm is None else float(norm))
