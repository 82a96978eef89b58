"""``HybridEngineRolloutConfig``: the rollout's knobs, validated when built."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

STRATEGIES = ("generate",)
CACHE_POLICIES = ("retain", "release")


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
    profile_forwards: bool = True
    """With profiling on, also time every forward (the prefill/decode split). Off leaves the model unhooked
    and the forward-derived profile fields ``None``."""
    cache_policy: str = "retain"
    """``retain`` keeps inference workspaces and the accelerator's cached memory between calls; ``release``
    frees them at the end of every call (``release_workspace()``), timed as ``inference_cache_ms``."""
    ignore_eos: bool = False
    """Benchmark mode: generation does not stop at EOS, so every row runs ``max_new_tokens`` steps. The
    returned batch still follows the contract (trimmed and padded after the first EOS)."""

    merge_adapters: bool = False
    """For a PEFT model: merge the LoRA adapters into the base weights for generation and unmerge them
    after (timed as ``lora_fuse_ms``/``lora_unfuse_ms``). Greedy tokens match unmerged generation within
    the dtype's rounding; an unmerged adapter costs extra matmuls at every step."""

    def __post_init__(self) -> None:
        for name in ("enable_profiling", "profile_forwards", "ignore_eos", "merge_adapters"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool; got {getattr(self, name)!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {list(STRATEGIES)}; got {self.strategy!r}")
        if self.cache_policy not in CACHE_POLICIES:
            raise ValueError(f"cache_policy must be one of {list(CACHE_POLICIES)}; got {self.cache_policy!r}")

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
