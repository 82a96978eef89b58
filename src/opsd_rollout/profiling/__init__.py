"""Opt-in profiling: one clock abstraction, stage recording, forward-pass timing, peak memory."""

from opsd_rollout.profiling.clock import Clock, synchronize
from opsd_rollout.profiling.forward import ForwardTime, ForwardTimer
from opsd_rollout.profiling.memory import PeakMemory
from opsd_rollout.profiling.profile import DEEPSPEED_ALIASES, RolloutProfile
from opsd_rollout.profiling.recorder import NULL_RECORDER, Span, StageRecorder

__all__ = ["Clock", "DEEPSPEED_ALIASES", "ForwardTime", "ForwardTimer", "NULL_RECORDER", "PeakMemory",
           "RolloutProfile", "Span", "StageRecorder", "synchronize"]
