"""The sections of a ``TrainConfig`` and the flat names that reach into them.

A run's config nests each owner's own config (DeepSpeed's ``SamplingConfig``, the rollout's, the loss's, the teacher
cache's, the optimisation's, the task evaluation's, the adapters'); the command line names their fields flat
(``--loss``, ``--lr``). This module says which flat name sets which section's field, and reads a section back from
the JSON a run saved.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any

from deepspeed.runtime.rollout.base import SamplingConfig

from opsd_rollout.opsd.divergence import DivergenceConfig
from opsd_rollout.opsd.teacher import TeacherCacheConfig
from opsd_rollout.rollout.config import HybridEngineRolloutConfig
from opsd_rollout.train.eval_file import TaskEvalConfig
from opsd_rollout.train.lora import AdapterConfig
from opsd_rollout.train.optimization import OptimizationConfig

SECTIONS = {"sampling": SamplingConfig, "rollout": HybridEngineRolloutConfig, "divergence": DivergenceConfig,
            "teacher_cache": TeacherCacheConfig, "optimization": OptimizationConfig, "task_eval": TaskEvalConfig,
            "lora": AdapterConfig}
"""The nested sections and their owners' types."""
OPTIONAL_SECTIONS = ("teacher_cache", "task_eval")
"""Sections that may be ``None`` (not named); given a field by a flat name, they are built from it alone."""
FLAT = {
    "max_new_tokens": "sampling.max_new_tokens", "samples_per_prompt": "sampling.n_samples_per_prompt",
    "temperature": "sampling.temperature", "top_k": "sampling.top_k", "top_p": "sampling.top_p",
    "loss": "divergence.loss", "beta": "divergence.beta", "estimator": "divergence.estimator",
    "top_k_rest": "divergence.top_k_rest",
    "teacher_cache": "teacher_cache.mode", "teacher_top_k": "teacher_cache.top_k",
    "deepspeed": "optimization.deepspeed", "zero_stage": "optimization.zero_stage", "lr": "optimization.lr",
    "gradient_accumulation_steps": "optimization.gradient_accumulation_steps",
    "eval_data": "task_eval.data", "eval_scorer": "task_eval.scorer", "eval_samples": "task_eval.samples",
    "eval_max_new_tokens": "task_eval.max_new_tokens",
    "lora_rank": "lora.rank", "lora_alpha": "lora.alpha", "lora_targets": "lora.targets", "merge_lora": "lora.merge",
}
"""A flat name (a ``train`` flag's) -> the section field it sets; the names not listed are ``TrainConfig``'s own
fields."""


def is_flat(name: str, value: Any) -> bool:
    """Whether ``name`` is a flat name for a section's field, not the section itself (``teacher_cache`` is both:
    a mode, or the section; ``None`` is the section's "not named")."""
    return name in FLAT and not (name in SECTIONS and (value is None or isinstance(value, (dict, SECTIONS[name]))))


def section_from_json(kind: type, values: dict[str, Any]) -> Any:
    """A section read back from its JSON: nested dataclasses (the rollout's ``options``) built again, a dtype
    (written as its name) a dtype again."""
    values = dict(values)
    for f in fields(kind):
        if isinstance(values.get(f.name), dict) and f.default_factory is not MISSING:
            values[f.name] = section_from_json(type(f.default_factory()), values[f.name])
    if kind is TeacherCacheConfig and isinstance(values.get("dtype"), str):
        import torch

        values["dtype"] = getattr(torch, values["dtype"].removeprefix("torch."))
    return kind(**values)


def default_cache_mode(loss: str, *, served: bool = False) -> str:
    """The teacher cache a loss trains on when none is named: ``sampled`` for ``sampled_reverse_kl``, else
    ``full`` (``topk`` from a served teacher, which never sends a whole vocabulary)."""
    return "sampled" if loss == "sampled_reverse_kl" else "topk" if served else "full"
