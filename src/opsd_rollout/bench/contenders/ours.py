"""``static`` and ``generate``, one contender per strategy of our engine: our ``HybridEngineRollout`` with the config's
engine axes, the workload's response lengths forced by the bench's own hook (``WorkloadRollout``); its OPSD step
is ``opsd_step``."""

from __future__ import annotations

from typing import Any

from opsd_rollout.bench.workload import WorkloadRollout
from opsd_rollout.opsd import StepProfile, opsd_step
from opsd_rollout.rollout import HybridEngineRollout, HybridEngineRolloutConfig


def build(built: Any, config: Any) -> WorkloadRollout:
    cfg = HybridEngineRolloutConfig.from_flat(**{"enable_profiling": True, **config.engine_fields})
    rollout = HybridEngineRollout(built.engine, built.tokenizer, cfg)
    return WorkloadRollout(rollout, config.lengths, rollout.eos_token_ids)


def step(engine: Any, teacher: Any, rollout: Any, request: Any, sampling: Any, divergence: Any, cache: Any,
         state: Any) -> StepProfile:
    return opsd_step(engine, teacher, rollout, request, sampling, divergence=divergence, teacher_cache=cache,
                     state=state)


def skip_reason(config: Any) -> str | None:
    return None
