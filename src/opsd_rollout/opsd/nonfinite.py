"""A non-finite step never reaches the weights, as DeepSpeed's loss scaler skips an overflow.

Two rules, and no collective of their own:

- a non-finite loss on any rank makes every rank's gradient non-finite (``one_or_nan``: ``token_mean`` multiplies
  the loss it returns by it, read from the all-reduce that already sums the loss; a device op, no host read): a NaN
  does not always reach every gradient by itself (a NaN teacher value is a constant to the student's graph);
- a non-finite gradient skips the optimizer step on every rank (the gradient is averaged over the ranks, so its norm
  is alike on each). DeepSpeed's own optimizers check that norm and skip, counting ``engine.skipped_steps``: ZeRO 1-3
  (any dtype), bf16 and fp16 at ZeRO-0. Its plain one (ZeRO-0 in float32: the torch optimizer itself) steps whatever
  it is given, so ``plain_step_guard`` skips it there, the same way.

Which part went non-finite (``nonfinite_part``) is looked for only in a step whose loss already is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

NONFINITE_PARTS = ("gradient", "loss", "student forward", "teacher cache")
"""What can go non-finite in a step, each upstream of the one before: a step is named by its first (its latest
here)."""


def one_or_nan(loss: torch.Tensor) -> torch.Tensor:
    """1 where ``loss`` (a 0-d tensor) is finite, else NaN: what the loss to backpropagate is multiplied by (a device
    op, no host read; multiplying by 1 changes no bit)."""
    return torch.where(torch.isfinite(loss), 1.0, float("nan")).to(loss.dtype)


def plain_optimizer(engine: Any) -> bool:
    """Whether DeepSpeed steps ``engine``'s optimizer as it is (ZeRO-0 in float32): no norm of its own, no skip."""
    return engine.zero_optimization_stage() == 0 and not (engine.bfloat16_enabled() or engine.fp16_enabled())


@contextlib.contextmanager
def plain_step_guard(engine: Any, norm: torch.Tensor) -> Iterator[bool]:
    """Around ``engine.step()`` at an accumulation boundary of a plain optimizer: when ``norm`` (the accumulated
    gradient's, alike on every rank) is not finite, the optimizer's ``step`` does nothing for this one call (shadowed
    on the instance, the class's own again after) and its ``overflow`` is set, which DeepSpeed's engine reads after
    the step as it reads its fp16 optimizer's: the step counts in ``engine.skipped_steps``, the learning-rate schedule
    stays, and the engine zeroes the gradients as after any step. One host read of ``norm``, where DeepSpeed's
    optimizers read theirs. Yields whether it skips."""
    optimizer = engine.optimizer
    skip = not bool(torch.isfinite(norm))
    optimizer.overflow = skip
    if skip:
        optimizer.step = _no_step
    try:
        yield skip
    finally:
        if skip:
            del optimizer.step


def _no_step(*_args: Any, **_kwargs: Any) -> None:
    return None


def _holds_nonfinite(values: torch.Tensor, minus_inf: bool = False) -> bool:
    """NaN or infinite (``minus_inf``: -inf allowed, a log-probability of 0 or a masked logit)."""
    bad = torch.isnan(values) | (torch.isposinf(values) if minus_inf else torch.isinf(values))
    return bool(bad.any())


def nonfinite_part(caches: list[Any], out: torch.Tensor, total: torch.Tensor) -> str | None:
    """For a micro-batch whose loss (every rank's) is not finite, the first part of it that is not on this rank: the
    teachers' caches, the student's forward (``out``: logits or final hidden states), the loss (``total``, this
    rank's sum); ``None`` when all are finite here (another rank's went)."""
    if any(_holds_nonfinite(cache.values, minus_inf=True) for cache in caches if cache is not None):
        return "teacher cache"
    if _holds_nonfinite(out.detach()):
        return "student forward"
    return "loss" if _holds_nonfinite(total.detach()) else None
