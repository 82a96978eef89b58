"""The rollout engine: config and validation, post-processing, generation strategies, DeepSpeed's factory.

``HybridEngineRollout`` and ``build_rollout`` load on first use (PEP 562, ``opsd_rollout.lazy``): the config module
alone is light, and the command line reads it for its help."""

from __future__ import annotations

from typing import TYPE_CHECKING

from opsd_rollout.lazy import lazy_exports

_EXPORTS = {"HybridEngineRollout": ".engine", "HybridEngineRolloutConfig": ".config", "RolloutOptions": ".config",
            "build_rollout": ".factory"}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from opsd_rollout.rollout.config import HybridEngineRolloutConfig, RolloutOptions
    from opsd_rollout.rollout.engine import HybridEngineRollout
    from opsd_rollout.rollout.factory import build_rollout

__getattr__ = lazy_exports(globals(), _EXPORTS)
