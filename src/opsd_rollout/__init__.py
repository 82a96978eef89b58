"""opsd-rollout: profiled, fast rollouts for on-policy (self-)distillation on DeepSpeed.

``HybridEngineRollout`` is a drop-in for DeepSpeed's; the request, sampling and batch dataclasses are
DeepSpeed's own, re-exported so one import serves both. The names load on first use (PEP 562), so the
command line's ``--help`` does not pay for importing torch and DeepSpeed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "HybridEngineRollout": "opsd_rollout.rollout.engine",
    "HybridEngineRolloutConfig": "opsd_rollout.rollout.config",
    "RolloutProfile": "opsd_rollout.profiling.profile",
    "RolloutBatch": "deepspeed.runtime.rollout.base",
    "RolloutEngine": "deepspeed.runtime.rollout.base",
    "RolloutRequest": "deepspeed.runtime.rollout.base",
    "SamplingConfig": "deepspeed.runtime.rollout.base",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:
    from deepspeed.runtime.rollout.base import RolloutBatch, RolloutEngine, RolloutRequest, SamplingConfig

    from opsd_rollout.profiling.profile import RolloutProfile
    from opsd_rollout.rollout.config import HybridEngineRolloutConfig
    from opsd_rollout.rollout.engine import HybridEngineRollout


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'opsd_rollout' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value
