"""On-policy distillation: response targets, a host teacher-logit cache, chunked divergences, one profiled step."""

from opsd_rollout.opsd.divergence import DivergenceConfig, chunked_divergence, generalized_jsd, token_divergence
from opsd_rollout.opsd.step import StepProfile, opsd_step
from opsd_rollout.opsd.targets import ResponseTargets, response_targets
from opsd_rollout.opsd.teacher import TeacherCache, TeacherCacheBuffers, TeacherCacheConfig, build_teacher_cache

__all__ = ["DivergenceConfig", "ResponseTargets", "StepProfile", "TeacherCache", "TeacherCacheBuffers", "TeacherCacheConfig",
           "build_teacher_cache", "chunked_divergence", "generalized_jsd", "opsd_step", "response_targets",
           "token_divergence"]
