"""Opt-in profiling: one clock abstraction, stage recording, forward-pass timing, phase probes, peak memory,
train/eval switch timing and trace export."""

from opsd_rollout.profiling.clock import Clock, synchronize
from opsd_rollout.profiling.forward import ForwardTime, ForwardTimer
from opsd_rollout.profiling.memory import PeakMemory
from opsd_rollout.profiling.model_time import HiddenForwardsError, ModelTimeProfiler, profile_model_time
from opsd_rollout.profiling.probes import PhaseProbes, PhaseTotal
from opsd_rollout.profiling.profile import DEEPSPEED_ALIASES, RolloutProfile
from opsd_rollout.profiling.recorder import NULL_RECORDER, Span, StageRecorder
from opsd_rollout.profiling.transitions import ModeSwitchTimes, timed_eval

__all__ = ["Clock", "DEEPSPEED_ALIASES", "ForwardTime", "ForwardTimer", "HiddenForwardsError", "ModeSwitchTimes",
           "ModelTimeProfiler", "NULL_RECORDER", "PeakMemory", "PhaseProbes", "PhaseTotal", "RolloutProfile", "Span",
           "StageRecorder", "profile_model_time", "synchronize", "timed_eval"]
