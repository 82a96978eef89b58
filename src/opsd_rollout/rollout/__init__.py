"""The rollout engine: config and validation, post-processing, generation strategies, DeepSpeed's factory.

``HybridEngineRollout`` and ``build_rollout`` load on first use (PEP 562): the config module alone is light,
and the command line reads it for its help."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {"HybridEngineRollout": "opsd_rollout.rollout.engine",
            "HybridEngineRolloutConfig": "opsd_rollout.rollout.config",
            "RolloutOptions": "opsd_rollout.rollout.config",
            "build_rollout": "opsd_rollout.rollout.factory"}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from opsd_rollout.rollout.config import HybridEngineRolloutConfig, RolloutOptions
    from opsd_rollout.rollout.engine import HybridEngineRollout
    from opsd_rollout.rollout.factory import build_rollout


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'opsd_rollout.rollout' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
