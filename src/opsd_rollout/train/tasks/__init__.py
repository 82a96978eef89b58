"""Built-in tasks: training and held-out examples made by code from a seed, with answers to score (``--task``).

Light: the command line reads the task names and checks a split before torch loads (``Example`` is imported by the
functions that make examples)."""

from __future__ import annotations

import json
from pathlib import Path

from typing import TYPE_CHECKING

from opsd_rollout.files import write_text_atomic
from opsd_rollout.train.tasks.arithmetic import ArithmeticTask, Problem

if TYPE_CHECKING:
    from opsd_rollout.train.data import Example

TASKS = {"arithmetic": ArithmeticTask(), "arithmetic-5d": ArithmeticTask(digits=5)}
"""The built-in tasks by name, each at its recipe."""
SCORERS = {name: "gsm8k" for name in TASKS}
"""The scorer that reads each task's answers (``scorers.SCORERS``)."""


def examples_of(problems: list[Problem]) -> list[Example]:
    """Problems as training examples: the worked solution the reference, a whole response (EOS after it)."""
    from opsd_rollout.train.data import Example  # heavy: see the module docstring

    return [Example(p.prompt, p.reference) for p in problems]


def task_examples(name: str, labelled: int | None = None,
                  unlabelled: int | None = None) -> tuple[list[Example], list[Example]]:
    """(train, held-out) examples of the built-in task ``name``: with ``labelled``, the first that many training
    problems keep their worked solution and the next ``unlabelled`` (default: the rest) are prompts alone."""
    from opsd_rollout.train.data import Example  # heavy: see the module docstring

    train, held_out = TASKS[name].problems()
    examples = examples_of(train)
    if labelled is not None:
        rest = len(train) - labelled if unlabelled is None else unlabelled
        examples = examples[:labelled] + [Example(e.prompt) for e in examples[labelled:labelled + rest]]
    return examples, examples_of(held_out)


def check_split(name: str | None, labelled: int | None, unlabelled: int | None) -> None:
    """A labelled set and unlabelled prompts that the task's training problems hold (and a task to split)."""
    if name is None:
        if labelled is not None or unlabelled is not None:
            raise ValueError("--task-labelled and --task-unlabelled split a built-in task's problems: give --task (a "
                             "prompt file says which lines have a 'reference' itself)")
        return
    size = TASKS[name].train_size
    if labelled is not None and not 0 < labelled <= size:
        raise ValueError(f"--task-labelled {labelled}: task {name!r} has {size:,} training problems; give 1 to {size:,}")
    if unlabelled is not None:
        if labelled is None:
            raise ValueError("--task-unlabelled counts the prompts after the labelled set: give --task-labelled too")
        if unlabelled < 0 or labelled + unlabelled > size:
            raise ValueError(f"--task-labelled {labelled} + --task-unlabelled {unlabelled} exceed the {size:,} training "
                             f"problems of task {name!r}")


def response_tokens(name: str) -> int:
    """The most tokens a response of task ``name`` needs: its longest worked solution's bytes and the EOS (a
    byte-level tokenizer's count, which a byte-level BPE's never exceeds)."""
    train, held_out = TASKS[name].problems()
    return max(len(p.reference.encode()) for p in train + held_out) + 1


def write_eval_file(name: str, path: str | Path) -> Path:
    """The held-out problems of task ``name`` as an eval file (``--eval-data``: JSON lines with ``prompt``,
    ``reference`` and ``answer``), written whole."""
    _, held_out = TASKS[name].problems()
    write_text_atomic(path, "".join(json.dumps(p.record()) + "\n" for p in held_out))
    return Path(path)
