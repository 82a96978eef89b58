"""Opt-in profiling: one clock abstraction, stage recording, forward-pass timing, phase probes, peak memory,
train/eval switch timing and trace export.

The names load on first use (PEP 562, ``opsd_rollout.lazy``): importing one submodule (``profiling.clock``) does
not import the others (the forward timer and the phase probes import torch's compiler).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opsd_rollout.lazy import lazy_exports

_EXPORTS = {
    "Clock": ".clock", "synchronize": ".clock",
    "ForwardTime": ".forward", "ForwardTimer": ".forward",
    "PeakMemory": ".memory",
    "HiddenForwardsError": ".model_time", "ModelTimeProfiler": ".model_time", "profile_model_time": ".model_time",
    "PhaseProbes": ".probes", "PhaseTotal": ".probes",
    "DEEPSPEED_ALIASES": ".profile", "RolloutProfile": ".profile",
    "NULL_RECORDER": ".recorder", "Span": ".recorder", "StageRecorder": ".recorder",
    "ModeSwitchTimes": ".transitions", "timed_eval": ".transitions",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from opsd_rollout.profiling.clock import Clock, synchronize
    from opsd_rollout.profiling.forward import ForwardTime, ForwardTimer
    from opsd_rollout.profiling.memory import PeakMemory
    from opsd_rollout.profiling.model_time import HiddenForwardsError, ModelTimeProfiler, profile_model_time
    from opsd_rollout.profiling.probes import PhaseProbes, PhaseTotal
    from opsd_rollout.profiling.profile import DEEPSPEED_ALIASES, RolloutProfile
    from opsd_rollout.profiling.recorder import NULL_RECORDER, Span, StageRecorder
    from opsd_rollout.profiling.transitions import ModeSwitchTimes, timed_eval

__getattr__ = lazy_exports(globals(), _EXPORTS)
