"""Training with the OPSD step: ``train(TrainConfig(...))`` (``opsd-rollout train``), a loop from a prompt file
to a checkpoint, with held-out evaluation, metrics where users look and exact resume.

Light at import (the names load when used), so the command line checks a run's arguments and files
(``train.preflight``) before torch, transformers and DeepSpeed load."""

__all__ = ["Example", "OptimizationConfig", "TeacherSpec", "TrainConfig", "TrainResult", "load_train_config",
           "read_examples", "sft_step", "train"]

_HOMES = {"Example": "data", "read_examples": "data", "TrainConfig": "config", "load_train_config": "config",
          "TrainResult": "loop", "train": "loop", "OptimizationConfig": "setup", "sft_step": "sft",
          "TeacherSpec": "teacher_spec"}
"""Each public name -> the module of ``opsd_rollout.train`` that defines it."""


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(name)
    import importlib

    from opsd_rollout.quiet import cpu_fallback_hidden

    with cpu_fallback_hidden():  # a library user's first import of DeepSpeed is often this one: quiet, as train()
        return getattr(importlib.import_module(f"opsd_rollout.train.{_HOMES[name]}"), name)
