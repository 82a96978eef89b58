"""opsd-rollout: profiled, fast rollouts for on-policy (self-)distillation on DeepSpeed.

``HybridEngineRollout`` is a drop-in for DeepSpeed's; the request, sampling and batch dataclasses are
DeepSpeed's own, re-exported so one import serves both.
"""

from deepspeed.runtime.rollout.base import RolloutBatch, RolloutEngine, RolloutRequest, SamplingConfig

from opsd_rollout.profiling import RolloutProfile
from opsd_rollout.rollout import HybridEngineRollout, HybridEngineRolloutConfig

__version__ = "0.1.0"

__all__ = ["HybridEngineRollout", "HybridEngineRolloutConfig", "RolloutBatch", "RolloutEngine", "RolloutProfile",
           "RolloutRequest", "SamplingConfig", "__version__"]
