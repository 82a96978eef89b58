"""The student's side of an OPSD step (and of SFT's): its forward over the response window (the logits, or the final
hidden states when the loss runs fused with the LM head), the divergence over it, the mean over every rank's tokens,
and the optimizer step with its gradient norm."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from opsd_rollout.distributed import several_ranks
from opsd_rollout.modeling import innermost_model, position_ids
from opsd_rollout.opsd.divergence import DivergenceConfig, chunked_divergence
from opsd_rollout.opsd.fused import head_divergence
from opsd_rollout.opsd.nonfinite import one_or_nan, plain_optimizer, plain_step_guard
from opsd_rollout.opsd.sampled import head_sampled_divergence, sampled_divergence
from opsd_rollout.opsd.step_profile import StepParts
from opsd_rollout.opsd.targets import ResponseTargets
from opsd_rollout.opsd.teacher import TeacherCache

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine


def engine_step(engine: DeepSpeedEngine, *, grad_norm: bool = False) -> Any:
    """``engine.step()``; with ``grad_norm``, at an accumulation boundary (the call that steps the optimizer), the
    2-norm of the gradient it stepped on, before clipping: DeepSpeed's own (ZeRO 1-3, bf16 and fp16 keep it), or at
    ZeRO-0 in float32, where DeepSpeed keeps none, taken here before the step from the gradients the backwards left
    (accumulated over the micro-batches, each scaled by 1 / ``gradient_accumulation_steps``, and averaged over the
    ranks by the boundary's backward: alike on every rank). A number or a 0-d tensor (read it once the step's marks
    are resolved, not to sync mid-step); ``None`` between boundaries and without ``grad_norm``.

    A non-finite gradient is never stepped on (``opsd.nonfinite``): DeepSpeed's optimizers skip it, and at ZeRO-0 in
    float32 the norm taken here does (read once, before the step)."""
    at_boundary = engine.is_gradient_accumulation_boundary()
    ours = None
    if at_boundary and plain_optimizer(engine):
        grads = [p.grad.detach() for p in engine.module.parameters() if p.grad is not None]
        ours = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        with plain_step_guard(engine, ours):
            engine.step()
    else:
        engine.step()
    if not (grad_norm and at_boundary):
        return None
    theirs = engine.get_global_grad_norm()
    return ours if theirs is None else theirs


def student_logits(engine: torch.nn.Module, targets: ResponseTargets) -> torch.Tensor:
    """The student's logits over the response window [N, R, V]: its whole forward (an OPSD step's unfused loss and
    the SFT step's cross-entropy both read them), positions counted from each row's first real token."""
    out = engine(input_ids=targets.input_ids, attention_mask=targets.attention_mask,
                 position_ids=position_ids(targets.attention_mask), use_cache=False)  # one pass: no cache to keep
    return out.logits[:, targets.window]  # [N, R, V]


def student_hidden(engine: torch.nn.Module, targets: ResponseTargets) -> torch.Tensor:
    """The student's final hidden states over the response window [N, R, H]: its forward with the LM head run on
    one position only (the fused loss runs the head itself)."""
    out = engine(input_ids=targets.input_ids, attention_mask=targets.attention_mask,
                 position_ids=position_ids(targets.attention_mask), output_hidden_states=True, logits_to_keep=1,
                 use_cache=False)
    return out.hidden_states[-1][:, targets.window]


def student_forward(parts: StepParts, engine: torch.nn.Module, targets: ResponseTargets, fused: bool) -> torch.Tensor:
    """The student's forward: its final hidden states over the response window [N, R, H] when the loss runs fused
    with the LM head, else its logits [N, R, V]."""
    return parts.run("student_forward", student_hidden if fused else student_logits, engine, targets)


def student_loss(parts: StepParts, engine: torch.nn.Module, out: torch.Tensor, targets: ResponseTargets,
                  cache: TeacherCache, divergence: DivergenceConfig, fused: bool,
                  behaviour_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The divergence's sum and count over ``out`` (``student_forward``'s): fused with the LM head, or over
    whole logits."""
    if divergence.loss == "sampled_reverse_kl":
        if fused:
            return parts.run("loss", head_sampled_divergence, innermost_model(engine), out, targets.labels,
                             cache.values, targets.mask.to(out.device), divergence, behaviour_logp)
        return parts.run("loss", sampled_divergence, out, targets.labels, cache.values, targets.mask, divergence,
                         behaviour_logp)
    if fused:
        return parts.run("loss", head_divergence, innermost_model(engine), out, cache.stored,
                         targets.mask.to(out.device), divergence)
    return parts.run("loss", chunked_divergence, out, lambda s, e: cache.chunk(s, e, out.device),
                     targets.mask.to(out.device), divergence)


def token_mean(total: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss to backpropagate and the value to report (a device scalar, read after the step): the mean over
    every rank's valid tokens.

    DeepSpeed averages gradients over ranks, so each rank scales its sum by ``world_size / global count``;
    dividing by its own count would weight ranks with fewer valid tokens too much. A loss that is not finite on any
    rank makes the loss's scale NaN on every rank (``opsd.nonfinite``): every gradient is then non-finite and the step
    skipped alike.
    """
    if not several_ranks():
        mean = total / count.clamp(min=1)
        return mean * one_or_nan(total.detach()), mean.detach()
    both = torch.stack([total.detach().float(), count.float()]).to(total.device)
    dist.all_reduce(both)
    global_count = both[1].clamp(min=1)
    return total * dist.get_world_size() / global_count * one_or_nan(both[0]), both[0] / global_count
