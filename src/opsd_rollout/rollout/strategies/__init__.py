"""Generation strategies: each turns expanded prompts into generated tokens ``[N, R']``.

A strategy only generates; expansion, EOS trimming and masks are the engine's, so every strategy gets
the same output contract for free. ``static`` (our decode loop over a reusable KV workspace) and
``generate`` (transformers') sit side by side; ``make_strategy`` picks one from the config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from opsd_rollout.rollout.strategies.generate import TransformersGenerate
from opsd_rollout.rollout.strategies.static import StaticDecode
from opsd_rollout.rollout.target import RolloutTarget
from opsd_rollout.rollout.validation import RolloutPlan
from opsd_rollout.rollout.workspace import KVWorkspace

if TYPE_CHECKING:
    from opsd_rollout.rollout.config import HybridEngineRolloutConfig


class GenerationStrategy(Protocol):
    name: str
    workspace: KVWorkspace | None
    """What the strategy keeps between calls (its allocation is timed, its reuse reported), or ``None``."""

    def unsupported_reason(self, target: RolloutTarget) -> str | None:
        """Why this strategy cannot run ``target`` (the rollout then uses ``generate``), or ``None``."""
        ...

    def generate(self, target: RolloutTarget, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 plan: RolloutPlan) -> torch.Tensor:
        """prompt_ids, prompt_mask: [N, P] left-padded. Returns ``[N, P + R']``: the prompts exactly as given,
        then the generated tokens (``R' <= max_new_tokens``), in a tensor the caller may write into."""
        ...

    def release_workspace(self) -> None:
        """Free whatever the strategy keeps between calls."""
        ...


def make_strategy(cfg: "HybridEngineRolloutConfig") -> GenerationStrategy:
    """The strategy ``cfg.strategy`` names, configured from ``cfg``."""
    if cfg.strategy == StaticDecode.name:
        return StaticDecode(shared_prefill=cfg.shared_prefill, stop_check_interval=cfg.stop_check_interval,
                            seed=cfg.seed, compile_decode=cfg.compile_decode, static_shapes=cfg.static_shapes)
    if cfg.strategy == TransformersGenerate.name:
        return TransformersGenerate()
    raise ValueError(f"unknown strategy {cfg.strategy!r}")


__all__ = ["GenerationStrategy", "StaticDecode", "TransformersGenerate", "make_strategy"]
