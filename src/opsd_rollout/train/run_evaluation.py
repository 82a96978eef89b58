"""``RunEvaluation``: what a training run evaluates at step 0 and every ``eval_every`` steps.

The held-out figures (the student's reverse KL to its teacher on its own samples, cross-entropy on references), the
task's accuracy when the run has an eval file, and at step 0 the teacher's own task figures: what the student is read
against. Every rank evaluates its share of the held-out prompts; the figures are reduced over the ranks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from opsd_rollout.distributed import RankInfo
from opsd_rollout.opsd.self_teacher import SelfTeacher
from opsd_rollout.opsd.served import ServedTeacher
from opsd_rollout.seeding import seed_of
from opsd_rollout.train.config import TrainConfig
from opsd_rollout.train.data import Encoder, Example
from opsd_rollout.train.evaluate import evaluate
from opsd_rollout.train.setup import Models
from opsd_rollout.train.task_eval import Problem, TaskEvalResult, evaluate_task

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RunEvaluation:
    """A run's evaluation: its config, models and held-out data, and the student's engine and rollout it reads."""

    config: TrainConfig
    models: Models
    engine: Any
    """The student's DeepSpeed engine."""
    rollout: Any
    """The student's rollout (``HybridEngineRollout``)."""
    teacher: Any
    """The teacher(s) as placed beside the student (``None`` for SFT)."""
    encoder: Encoder
    held_out: list[Example]
    problems: list[Problem] | None
    """The eval file's problems, when the run has one."""
    rank: RankInfo
    reprompt: bool
    """Whether the teachers see their own prompts (a context built from each example's reference)."""

    def evaluate(self, *, teacher: bool = False) -> dict[str, float]:
        """The held-out figures, the task evaluation's when there is one, and with ``teacher`` (step 0) the
        teacher's task figures."""
        examples = self.held_out[:self.config.eval_prompts]
        shard = examples[self.rank.rank::self.rank.world_size][:len(examples) // self.rank.world_size or 1]
        start = time.perf_counter()
        figures = evaluate(self.engine, self.teacher, self.rollout, self.encoder, shard, self.config.sampling,
                           seed=seed_of(self.config.seed, 2**31), batch_size=self.config.prompts_per_micro_batch,
                           default_teacher=self.config.default_teacher_name, teacher_prompts=self.reprompt)
        if self.problems is not None:
            if teacher:
                figures.update(self.teacher_task())
            task_start = time.perf_counter()
            figures.update(self.task(self.engine, self.rollout).record())
            figures["time/task_evaluation_ms"] = (time.perf_counter() - task_start) * 1e3
        return {**figures, "time/evaluation_ms": (time.perf_counter() - start) * 1e3}

    def task(self, model: Any, rollout: Any) -> TaskEvalResult:
        """``model``'s task figures, generating with ``rollout``: greedy accuracy, and pass@k with ``samples``."""
        task = self.config.task_eval
        if task is None or self.problems is None:
            raise RuntimeError("the run has no task to evaluate (task_eval)")
        return evaluate_task(model, rollout, self.models.tokenizer, self.problems, task, self.config.sampling,
                             max_new_tokens=task.new_tokens(self.config.sampling.max_new_tokens),
                             seed=seed_of(self.config.seed, 2**31, 1),
                             batch_size=self.config.prompts_per_micro_batch)

    def teacher_task(self) -> dict[str, float]:
        """The teacher's task figures (``teacher_eval_*``), once: what the student is read against. A served teacher
        scores tokens and does not generate, so it is not scored (a line says so)."""
        if self.teacher is None:
            return {}
        if self.config.several:
            if self.rank.rank == 0:
                logger.warning("with several teachers, none is scored on --eval-data here: for a teacher's figure, "
                               "run opsd-rollout eval --model on its checkpoint")
            return {}
        if isinstance(self.teacher, SelfTeacher) or self.config.teachers[0].is_self:
            if self.rank.rank == 0:
                logger.warning("the self-teacher is not scored on --eval-data: it is the student's own weights, shown "
                               "the reference in training; the student's figure at step 0 is its starting point")
            return {}
        if isinstance(self.teacher, ServedTeacher):
            if self.rank.rank == 0:
                logger.warning("the served teacher is not scored on --eval-data (a teacher server scores tokens, it "
                               "does not generate): for its figure, run opsd-rollout eval --model on its checkpoint")
            return {}
        from opsd_rollout.rollout import HybridEngineRollout

        rollout = HybridEngineRollout(self.teacher, self.models.tokenizer,
                                      self.config.rollout.replace(enable_profiling=False))
        try:
            return self.task(self.teacher, rollout).record("teacher_eval_")
        finally:
            rollout.shutdown()
