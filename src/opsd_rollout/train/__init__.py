"""Training with the OPSD step: ``train(TrainConfig(...))`` (``opsd-rollout train``), a loop from a prompt file
to a checkpoint, with held-out evaluation, metrics where users look and exact resume.

Light at import (the names load when used: PEP 562, ``opsd_rollout.lazy``), so the command line checks a run's
arguments and files (``train.preflight``) before torch, transformers and DeepSpeed load."""

from __future__ import annotations

from typing import TYPE_CHECKING

from opsd_rollout.lazy import lazy_exports

_EXPORTS = {"Example": ".data", "read_examples": ".data", "TrainConfig": ".config", "load_train_config": ".config",
            "TrainResult": ".loop", "train": ".loop", "OptimizationConfig": ".optimization", "sft_step": ".sft",
            "TeacherSpec": ".teacher_spec"}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from opsd_rollout.train.config import TrainConfig, load_train_config
    from opsd_rollout.train.data import Example, read_examples
    from opsd_rollout.train.loop import TrainResult, train
    from opsd_rollout.train.optimization import OptimizationConfig
    from opsd_rollout.train.sft import sft_step
    from opsd_rollout.train.teacher_spec import TeacherSpec

_load = lazy_exports(globals(), _EXPORTS)


def __getattr__(name: str) -> object:
    from opsd_rollout.quiet import cpu_fallback_hidden

    with cpu_fallback_hidden():  # a library user's first import of DeepSpeed is often this one: quiet, as train()
        return _load(name)
