"""On-policy distillation: response targets, a host teacher-logit cache (from a teacher in-process or served),
chunked divergences, the LM head fused with the divergence, one profiled step, and DeepSpeed's OPSD loss
(``generalized_jsd_loss``) and targets (``ResponseTokenBatch``) on top of them."""

from deepspeed.runtime.rollout.opsd import JSDLossOutput, ResponseTokenBatch

from opsd_rollout.opsd.divergence import (DivergenceConfig, chunked_divergence, generalized_jsd, generalized_jsd_loss,
                                          pointwise_jsd, token_divergence)
from opsd_rollout.opsd.fused import fused_divergence, head_divergence
from opsd_rollout.opsd.in_flight import StepInFlight
from opsd_rollout.opsd.self_teacher import SelfTeacher
from opsd_rollout.opsd.served import ServedTeacher
from opsd_rollout.opsd.step import OPSDStep, StepState, opsd_step
from opsd_rollout.opsd.step_profile import StepProfile
from opsd_rollout.opsd.targets import ResponseTargets, response_targets
from opsd_rollout.opsd.teacher import TeacherCache, TeacherCacheBuffers, TeacherCacheConfig, build_teacher_cache

__all__ = ["DivergenceConfig", "JSDLossOutput", "OPSDStep", "ResponseTargets", "ResponseTokenBatch", "SelfTeacher", "ServedTeacher", "StepInFlight",
           "StepProfile", "StepState", "TeacherCache", "TeacherCacheBuffers", "TeacherCacheConfig", "build_teacher_cache", "chunked_divergence",
           "fused_divergence", "generalized_jsd", "generalized_jsd_loss", "head_divergence", "opsd_step",
           "pointwise_jsd", "response_targets", "token_divergence"]
