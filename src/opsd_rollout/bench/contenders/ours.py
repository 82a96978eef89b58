"""``static`` and ``generate``, one contender per strategy of our engine: our ``HybridEngineRollout`` with the config's
engine axes, the workload's response lengths forced by the bench's own hook (``WorkloadRollout``); its OPSD step
is ``OPSDStep``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opsd_rollout.bench.workload import WorkloadRollout
from opsd_rollout.opsd import OPSDStep, StepProfile
from opsd_rollout.rollout import HybridEngineRollout, HybridEngineRolloutConfig


def build(built: Any, config: Any) -> WorkloadRollout:
    cfg = HybridEngineRolloutConfig.from_flat(**{"enable_profiling": True, **config.engine_fields})
    rollout = HybridEngineRollout(built.engine, built.tokenizer, cfg)
    return WorkloadRollout(rollout, config.lengths, rollout.eos_token_ids)


def build_step(engine: Any, teacher: Any, rollout: Any, sampling: Any, divergence: Any, cache: Any,
               state: Any) -> Callable[[Any], StepProfile]:
    """Our OPSD step, built once for a config: each call one step on a request."""
    return OPSDStep(engine=engine, teacher=teacher, rollout=rollout, sampling=sampling, divergence=divergence,
                    teacher_cache=cache, state=state)


def skip_reason(config: Any) -> str | None:
    return None
