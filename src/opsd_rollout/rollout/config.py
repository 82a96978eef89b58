"""``HybridEngineRolloutConfig``: the rollout's knobs, validated when built."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

STRATEGIES = ("generate",)


@dataclass(kw_only=True)
class HybridEngineRolloutConfig:
    """Configuration of :class:`opsd_rollout.HybridEngineRollout`.

    Accepts DeepSpeed's own ``HybridEngineRolloutConfig`` / ``RolloutConfig`` through :meth:`from_any`.
    """

    enable_profiling: bool = False
    """Record a ``RolloutProfile`` per call (``get_last_profile()``). Off: no synchronization, no hooks."""
    strategy: str = "generate"
    """Generation strategy: ``generate`` runs transformers' ``generate`` (through the hybrid engine's
    patched ``generate`` when the engine has one)."""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_profiling, bool):
            raise TypeError(f"enable_profiling must be a bool; got {self.enable_profiling!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {list(STRATEGIES)}; got {self.strategy!r}")

    @classmethod
    def from_any(cls, cfg: Any) -> "HybridEngineRolloutConfig":
        """Ours as is; ``None`` gives the defaults; a DeepSpeed config object is read by field name.

        DeepSpeed options this rollout does not implement are refused rather than ignored.
        """
        if cfg is None:
            return cls()
        if isinstance(cfg, cls):
            return cfg
        unsupported = {
            name: getattr(cfg, name) for name in ("use_graph_capture", "use_shared_prefill", "align_decode_fronts",
                                                  "enable_cache_trimming", "continuous_cache_capacity")
            if getattr(cfg, name, None) not in (None, False)
        }
        if unsupported:
            raise ValueError(f"cfg sets DeepSpeed options this rollout does not implement: {unsupported}; "
                             "leave them at their defaults")
        known = {f.name for f in fields(cls)}
        return cls(**{name: getattr(cfg, name) for name in known if hasattr(cfg, name)})
