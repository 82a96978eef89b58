"""Generation strategies: each turns expanded prompts into generated tokens ``[N, R']``.

A strategy only generates; expansion, EOS trimming and masks are the engine's, so every strategy gets
the same output contract for free. ``static`` (our decode loop over a reusable KV workspace) and
``generate`` (transformers') sit side by side; ``make_strategy`` picks one from the config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opsd_rollout.rollout.decode.stats import DecodeStats
from opsd_rollout.rollout.strategies.base import GenerationStrategy
from opsd_rollout.rollout.strategies.generate import TransformersGenerate
from opsd_rollout.rollout.strategies.static import StaticDecode

if TYPE_CHECKING:
    from opsd_rollout.rollout.config import HybridEngineRolloutConfig


def make_strategy(cfg: "HybridEngineRolloutConfig") -> GenerationStrategy:
    """The strategy ``cfg.strategy`` names, configured from ``cfg``."""
    if cfg.strategy == StaticDecode.name:
        return StaticDecode(shared_prefill=cfg.shared_prefill, seed=cfg.seed, compile_decode=cfg.compile_decode,
                            compact_rows=cfg.compact_rows, kv_budget_bytes=cfg.kv_budget_bytes,
                            cache_capacity=cfg.continuous_cache_capacity, options=cfg.options)
    if cfg.strategy == TransformersGenerate.name:
        return TransformersGenerate()
    raise ValueError(f"unknown strategy {cfg.strategy!r}")


__all__ = ["DecodeStats", "GenerationStrategy", "StaticDecode", "TransformersGenerate", "make_strategy"]
