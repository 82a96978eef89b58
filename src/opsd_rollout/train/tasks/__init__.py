"""Built-in tasks: training and held-out examples made by code from a seed, with answers to score (``--task``)."""

from __future__ import annotations

import json
from pathlib import Path

from opsd_rollout.files import write_text_atomic
from opsd_rollout.train.data import Example
from opsd_rollout.train.tasks.arithmetic import ArithmeticTask, Problem

TASKS = {"arithmetic": ArithmeticTask()}
"""The built-in tasks by name, each at its recipe."""
SCORERS = {"arithmetic": "gsm8k"}
"""The scorer that reads each task's answers (``scorers.SCORERS``)."""


def examples_of(problems: list[Problem]) -> list[Example]:
    """Problems as training examples: the worked solution the reference, a whole response (EOS after it)."""
    return [Example(p.prompt, p.reference) for p in problems]


def task_examples(name: str) -> tuple[list[Example], list[Example]]:
    """(train, held-out) examples of the built-in task ``name``."""
    train, held_out = TASKS[name].problems()
    return examples_of(train), examples_of(held_out)


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
