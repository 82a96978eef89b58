"""A task-evaluation file, read and checked whole before any model work: JSON lines, each with a ``prompt`` (or chat
``messages``) and the ``answer`` it should reach, scored by one of ``scorers.SCORERS``.

``answer`` is a bare answer (``72``, ``\\frac{1}{2}``) or a worked solution the scorer reads its answer from (GSM8K's
``answer`` field ending ``#### 72``, a MATH solution with its ``\\boxed{}``): see ``scorers.reference_answer``. Every
answer must hold one the scorer can read (one that cannot would only ever count wrong); a file where none does has
the wrong scorer, and says so. ``TaskEvalConfig`` is what a task evaluation scores (``train``'s and ``eval``'s
``--eval-*`` flags). Light (no torch): the command line checks them, and the file, before it loads a model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opsd_rollout import checks
from opsd_rollout.train.records import check_messages, numbered_lines
from opsd_rollout.train.scorers import SCORERS, check_scorer, reference_answer


@dataclass(frozen=True, kw_only=True)
class TaskEvalConfig:
    """What a task evaluation scores: ``opsd-rollout train``'s and ``opsd-rollout eval``'s ``--eval-*`` flags."""

    data: str | None = None
    """The eval file: JSON lines with ``prompt`` (or chat ``messages``) and ``answer`` (``read_eval_file``)."""
    scorer: str | None = None
    """How an answer is read: ``gsm8k``, ``boxed``, ``last-number`` or ``exact`` (``scorers.py``)."""
    samples: int = 1
    """K: samples per problem for pass@1 (averaged over K) and pass@K; 1: greedy accuracy alone."""
    max_new_tokens: int | None = None
    """Tokens a completion may take; ``None``: the run's ``--max-new-tokens`` (``train``), 256 (``eval``)."""

    def __post_init__(self) -> None:
        if self.data is None or self.scorer is None:
            given = ("--eval-data" if self.data is not None else "--eval-scorer" if self.scorer is not None
                     else "--eval-samples or --eval-max-new-tokens")
            missing = " and ".join(flag for flag, value in (("--eval-data", self.data), ("--eval-scorer", self.scorer))
                                   if value is None)
            raise ValueError(f"{given} needs {missing}: task evaluation scores an eval file (--eval-data FILE) with a "
                             "scorer (--eval-scorer gsm8k, boxed, last-number or exact)")
        checks.text("--eval-data", self.data, what="an eval file's path")
        try:
            check_scorer(self.scorer)
        except ValueError as error:
            raise ValueError(f"--eval-scorer: {error}") from None
        checks.integer("--eval-samples", self.samples, hint="samples per problem for pass@k; 1: greedy alone")
        checks.integer("--eval-max-new-tokens", self.max_new_tokens, optional=True)

    def new_tokens(self, default: int) -> int:
        """``max_new_tokens``, or ``default`` (the run's) when it is not given."""
        return default if self.max_new_tokens is None else self.max_new_tokens


@dataclass(frozen=True)
class EvalRecord:
    """One problem of an eval file, as written: the prompt (or the messages the tokenizer's chat template renders
    into one), the reference, and the reference's answer as the scorer reads it."""

    line: int
    """Its line in the file (1-based), for messages and the per-problem output."""
    prompt: str | None
    messages: list[dict[str, str]] | None
    reference: str
    answer: str


def _where(path: Path, line: int | None = None) -> str:
    return f"--eval-data {str(path)!r}" + (f" line {line}" if line is not None else "")


def _record(path: Path, number: int, text: str, scorer: str) -> tuple[EvalRecord | None, str]:
    """The line's record and its raw answer (``None`` for a record whose answer the scorer cannot read)."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{_where(path, number)} is not JSON: {error}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{_where(path, number)} is not a JSON object with 'prompt' (or 'messages') and 'answer'")
    if "prompt" not in record and "messages" not in record:
        raise ValueError(f"{_where(path, number)}: neither a 'prompt' nor 'messages'")
    prompt, messages = record.get("prompt"), record.get("messages")
    if messages is None and (not isinstance(prompt, str) or not prompt):
        raise ValueError(f"{_where(path, number)}: 'prompt' must be a non-empty string; got {prompt!r}")
    if messages is not None:
        messages = list(check_messages(messages, _where(path, number)))
    if "answer" not in record:
        raise ValueError(f"{_where(path, number)}: no 'answer'")
    reference = record["answer"]
    if isinstance(reference, bool) or not isinstance(reference, (str, int, float)) or str(reference).strip() == "":
        raise ValueError(f"{_where(path, number)}: 'answer' must be a non-empty string or a number; got "
                         f"{reference!r}")
    reference = str(reference)
    answer = reference_answer(scorer, reference)
    if answer is None:
        return None, reference
    return EvalRecord(number, prompt if messages is None else None, messages, reference, answer), reference


def read_eval_file(path: str | Path, scorer: str) -> list[EvalRecord]:
    """Every problem of the file at ``path``, checked: one line naming the file, the line and what is wrong for a
    missing file, a line that is not JSON, no prompt, no ``answer``, or an answer ``scorer`` cannot read."""
    check_scorer(scorer)
    path = Path(path)
    lines = numbered_lines(path, "--eval-data", "problem")
    records, unreadable = [], []
    for number, line in lines:
        record, reference = _record(path, number, line, scorer)
        if record is None:
            unreadable.append((number, reference))
        else:
            records.append(record)
    if not records:
        number, reference = unreadable[0]
        others = ", ".join(s for s in SCORERS if s != scorer)
        raise ValueError(f"{_where(path)}: no 'answer' holds one the {scorer} scorer can read (line {number}: "
                         f"{checks.quoted(reference)}): pick the scorer of the answers' format ({others})")
    if unreadable:
        number, reference = unreadable[0]
        raise ValueError(f"{_where(path, number)}: 'answer' {checks.quoted(reference)} holds no answer the {scorer} "
                         f"scorer can read ({len(unreadable)} of {len(lines)} such lines; it would only count wrong)")
    return records
