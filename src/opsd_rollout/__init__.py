"""opsd-rollout: profiled, fast rollouts for on-policy (self-)distillation on DeepSpeed.

A drop-in for ``deepspeed.runtime.rollout``: every name it exports is here. ``HybridEngineRollout``,
``build_rollout`` and ``generalized_jsd_loss`` are ours; the request, sampling, batch, config and OPSD target
dataclasses are DeepSpeed's own, re-exported so one import serves both. The names load on first use (PEP
562, ``opsd_rollout.lazy``), so the command line's ``--help`` does not pay for importing torch and DeepSpeed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opsd_rollout.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "HybridEngineRollout": "opsd_rollout.rollout.engine",
    "HybridEngineRolloutConfig": "opsd_rollout.rollout.config",
    "RolloutOptions": "opsd_rollout.rollout.config",
    "RolloutProfile": "opsd_rollout.profiling.profile",
    "build_rollout": "opsd_rollout.rollout.factory",
    "generalized_jsd_loss": "opsd_rollout.opsd.divergence",
    "JSDLossOutput": "deepspeed.runtime.rollout.opsd",
    "ResponseTokenBatch": "deepspeed.runtime.rollout.opsd",
    "RolloutBatch": "deepspeed.runtime.rollout.base",
    "RolloutConfig": "deepspeed.runtime.rollout.base",
    "RolloutEngine": "deepspeed.runtime.rollout.base",
    "RolloutRequest": "deepspeed.runtime.rollout.base",
    "SamplingConfig": "deepspeed.runtime.rollout.base",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:
    from deepspeed.runtime.rollout.base import (RolloutBatch, RolloutConfig, RolloutEngine, RolloutRequest,
                                                SamplingConfig)
    from deepspeed.runtime.rollout.opsd import JSDLossOutput, ResponseTokenBatch

    from opsd_rollout.opsd.divergence import generalized_jsd_loss
    from opsd_rollout.profiling.profile import RolloutProfile
    from opsd_rollout.rollout.config import HybridEngineRolloutConfig, RolloutOptions
    from opsd_rollout.rollout.engine import HybridEngineRollout
    from opsd_rollout.rollout.factory import build_rollout

__getattr__ = lazy_exports(globals(), _EXPORTS)
