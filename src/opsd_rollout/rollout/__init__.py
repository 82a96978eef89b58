"""The rollout engine: config and validation, post-processing, generation strategies."""

from opsd_rollout.rollout.config import HybridEngineRolloutConfig
from opsd_rollout.rollout.engine import HybridEngineRollout

__all__ = ["HybridEngineRollout", "HybridEngineRolloutConfig"]
