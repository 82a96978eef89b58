"""The student as its own teacher (on-policy self-distillation, OPSD as the field now says it: Zhao et al. 2026,
arXiv 2601.18734): one model plays both parts. The student samples from the problem alone; the teacher, the same
model shown a privileged context (the reference solution), scores those samples (``targets.reprompted`` lines its
prompt up with the student's responses).

Which weights teach (``SELF_WEIGHTS``):

- ``initial`` (the paper's fixed teacher): the student's starting weights, frozen. A LoRA student's are its base
  with the adapters disabled (PEFT's ``disable_adapter()``), no memory beyond the student's; a fully trained
  student's are a frozen copy made before its first step (``SelfTeacher.initial``), which a ZeRO-3 run partitions
  like any ZeRO-3 teacher.
- ``live``: the student as it is now, scored without gradient: one model, no copy at all.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any, cast

import torch

from opsd_rollout.modeling import innermost_model

SELF_WEIGHTS = ("initial", "live")


def is_adapted(module: torch.nn.Module) -> bool:
    """Whether ``module`` (or what it wraps: a DeepSpeed engine's ``module``) is a PEFT model with adapters."""
    inner = getattr(module, "module", module)
    return callable(getattr(inner, "disable_adapter", None))


class SelfTeacher(torch.nn.Module):
    """The student's weights as a teacher: ``initial`` or ``live`` (``SELF_WEIGHTS``).

    ``module`` is what runs: the student's own module (not registered, so the teacher's parameters are only the
    copy it keeps, if any: ``teacher_parameter_bytes`` says what it costs), or the frozen copy of its starting
    weights. Every forward runs in ``scoring()``: eval mode (no dropout, whatever mode training left the student
    in), no gradient, a LoRA student's adapters disabled for ``initial``."""

    def __init__(self, module: torch.nn.Module, weights: str, *, copied: bool = False):
        super().__init__()
        if weights not in SELF_WEIGHTS:
            raise ValueError(f"self teacher weights must be one of {', '.join(SELF_WEIGHTS)}; got {weights!r}")
        self.weights = weights
        self.copied = copied
        """``module`` is a frozen copy of the student's starting weights (kept, and counted, here)."""
        if copied:
            self.module = module  # registered: its parameters are the teacher's own memory
        else:
            object.__setattr__(self, "module", module)  # the student's: not the teacher's memory

    @classmethod
    def initial(cls, student: torch.nn.Module) -> "SelfTeacher":
        """The student's starting weights as a teacher, made before its first step: a LoRA student's base (its
        adapters disabled when it scores), else a frozen copy."""
        if is_adapted(student):
            return cls(student, "initial")
        frozen = copy.deepcopy(student).eval().requires_grad_(False)
        return cls(frozen, "initial", copied=True)

    @classmethod
    def live(cls, student: torch.nn.Module) -> "SelfTeacher":
        """The student as it is at each step, scored without gradient."""
        return cls(student, "live")

    @contextlib.contextmanager
    def scoring(self) -> Iterator[torch.nn.Module]:
        """The module to run, ready to score: eval mode (put back after), no gradient, and for ``initial`` on a
        LoRA student its adapters disabled."""
        module = self.module
        inner = getattr(module, "module", module)  # a DeepSpeed engine's model
        was_training = inner.training
        inner.eval()
        try:
            with torch.no_grad(), self._adapters_off(inner):
                yield module
        finally:
            if was_training:
                inner.train()

    def _adapters_off(self, inner: torch.nn.Module) -> Any:
        if self.weights == "initial" and not self.copied and is_adapted(inner):
            return cast(Any, inner).disable_adapter()  # PEFT's context: adapters off inside it
        return contextlib.nullcontext()

    @property
    def config(self) -> Any:
        """The model's config (the student's)."""
        return innermost_model(self.module).config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.scoring() as module:
            return module(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"weights={self.weights}, copied={self.copied}"


def scoring(teacher: torch.nn.Module) -> contextlib.AbstractContextManager[torch.nn.Module]:
    """``teacher`` ready to score: a ``SelfTeacher``'s own context (``SelfTeacher.scoring``), anything else as it
    is."""
    if isinstance(teacher, SelfTeacher):
        return teacher.scoring()
    return contextlib.nullcontext(teacher)
