"""A run's inputs, every one checked before any step: the run directory, the evaluation file, the models, the
examples and their split, and what the objective, the teachers and the data must agree on (``run_inputs``)."""

from __future__ import annotations

import logging
from typing import NamedTuple, cast

from opsd_rollout.train.checkpoint import find_checkpoint
from opsd_rollout.train.config import TrainConfig
from opsd_rollout.train.data import Example
from opsd_rollout.train.setup import Models, load_models, split_examples
from opsd_rollout.train.task_eval import Problem, task_problems

logger = logging.getLogger(__name__)


class RunInputs(NamedTuple):
    """What a run trains with, checked."""

    models: Models
    train: list[Example]
    held_out: list[Example]
    problems: list[Problem] | None
    """The task's problems, when the run is judged by one (``task_eval``)."""


COLD_LOSSES = ("jsd", "sampled_reverse_kl")
"""The losses measured at 0% task accuracy from a random student (benchmarks/RESULTS.md, "A student judged by
accuracy"): their signal lands on tokens the teacher never allows."""


def warn_if_cold(config: TrainConfig) -> None:
    """Once, before any work: a built-in preset (random weights) distilled with a loss measured to stay at 0% task
    accuracy from a random start, with no warm start, in a run judged by a task (the corpus run, judged by its
    held-out KL, which these losses do lower, is not warned of)."""
    from opsd_rollout.presets import PRESETS

    if (config.objective == "opsd" and not config.warmup_sft_steps and config.student in PRESETS
            and config.divergence.loss in COLD_LOSSES and config.task_eval is not None):
        logger.warning("the student %s has random weights, and %s from a random student stayed at 0%% task accuracy "
                       "where we measured it: warm-start it on the references (--warmup-sft-steps N), or use "
                       "forward_kl (docs/TRAINING.md, \"When does on-policy distillation pay off\")",
                       config.student, config.divergence.loss)


def check_example_teachers(examples: list[Example], names: set[str]) -> None:
    """Every example's ``teacher`` is one of the run's (a library caller's data; the command line's file is checked
    by line before torch loads)."""
    for number, example in enumerate(examples, 1):
        if example.teacher is not None and example.teacher not in names:
            raise ValueError(f"example {number} names teacher {example.teacher!r}, which is none of the run's "
                             f"teachers {sorted(names)}")


def run_inputs(config: TrainConfig) -> RunInputs:
    """``config``'s inputs, each checked before any model work where it can be, the models loaded, the examples
    read and split."""
    from opsd_rollout.distributed import rank_info
    from opsd_rollout.train.data import in_context, read_examples
    from opsd_rollout.train.eval_file import read_eval_file
    from opsd_rollout.train.run_dir import check_output_dir, check_resumed_run, clear_run
    from opsd_rollout.train.teacher_spec import check_self, context_of

    if config.resume is not None:
        find_checkpoint(config.resume)  # before any work: a directory without a checkpoint is refused
        check_resumed_run(config.resume, config)
    check_output_dir(config.run_dir, resume=config.resume, overwrite=config.overwrite)
    task = config.task_eval
    # before any model work (a task's file and scorer are both given: TaskEvalConfig checks)
    records = read_eval_file(cast(str, task.data), cast(str, task.scorer)) if task is not None else None
    if config.overwrite and rank_info().rank == 0:  # every check passed: the old run goes before any is written
        clear_run(config.run_dir)
    models = load_models(config)
    contexts = context_of(config.teachers, config.default_teacher)
    examples = read_examples(config.prompts, models.tokenizer, contexts) if config.prompts else None
    train_examples, held_out = split_examples(config, examples)
    if contexts is not None and examples is None:  # a built-in task's or the corpus's: text examples
        shown = [e for e in train_examples if e.reference is not None or contexts(e.teacher) is None]
        if len(shown) < len(train_examples):  # a task's prompts without a solution: nothing to show its teacher
            logger.warning("the teacher is shown each example's reference: its %d prompts without one are left out "
                           "(it trains on the %d labelled)", len(train_examples) - len(shown), len(shown))
        train_examples, held_out = in_context(shown, contexts), in_context(held_out, contexts)
    if config.warmup_sft_steps and not any(e.reference is not None for e in train_examples):
        raise ValueError(f"--warmup-sft-steps {config.warmup_sft_steps} trains on the examples with a 'reference', "
                         "and none has one")
    warn_if_cold(config)
    models.check_prompts(train_examples + held_out, config)
    references = all(e.reference is not None for e in train_examples)
    if config.objective == "sft" and not any(e.reference is not None for e in train_examples):
        raise ValueError("objective sft trains on references, and no example has a 'reference'")
    if config.off_policy == "references" and not references:
        raise ValueError("off_policy references trains on references: every example needs a 'reference'")
    teacher_samples = config.off_policy == "teacher" or (config.off_policy == "auto" and not references)
    check_self(config.teachers, config.objective, config.lmbda, teacher_samples)
    if config.several:
        check_example_teachers(train_examples + held_out, {spec.name for spec in config.teachers})
        if config.lmbda < 1 and teacher_samples:
            raise ValueError("with several teachers, the steps that are not on-policy train on references (off_policy "
                             "references, every example with a 'reference'), not on one teacher's samples: use "
                             "lmbda 1, or references")
    if not config.several and config.served and config.lmbda < 1 and teacher_samples:
        raise ValueError("the steps that are not on-policy would train on the teacher's samples, and a served "
                         "teacher scores tokens, it does not generate: use lmbda 1, or references (off_policy "
                         "references, every example with a 'reference')")
    problems = None
    if records is not None and task is not None:
        problems = task_problems(records, models.tokenizer, [models.student, models.teacher],
                                 task.new_tokens(config.sampling.max_new_tokens))
    return RunInputs(models, train_examples, held_out, problems)



