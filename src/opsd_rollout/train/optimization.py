"""How the student is optimised (``OptimizationConfig``): a section of ``TrainConfig``, which ``train.setup`` builds the
student's DeepSpeed engine from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opsd_rollout import checks
from opsd_rollout.deepspeed_config import LEARNING_RATE


@dataclass(frozen=True, kw_only=True)
class OptimizationConfig:
    """How the student is optimised: the user's DeepSpeed config, or one built from the fields below."""

    deepspeed: str | dict[str, Any] | None = None
    """The student's DeepSpeed config (a JSON file or a dict: ZeRO stage, optimizer, scheduler,
    ``gradient_accumulation_steps``, bf16, monitors); ``None``: one built from the fields below."""
    zero_stage: int = 0
    """ZeRO stage of the built config."""
    lr: float = LEARNING_RATE
    """AdamW learning rate of the built config (or when the user's config has no optimizer)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step in the built config; the user's config's own wins."""

    def __post_init__(self) -> None:
        checks.choice("zero_stage", self.zero_stage, (0, 1, 2, 3))
        checks.number("lr", self.lr, above=0)
        checks.integer("gradient_accumulation_steps", self.gradient_accumulation_steps)
