"""A built-in reasoning task made by code from a seed: multi-digit addition word problems whose references are worked,
digit-by-digit solutions ending in ``#### N`` (GSM8K's answer format).

A problem is a short story around numbers ("Mia has 347 apples and buys 258 more. How many apples now?"); its
solution adds them column by column from the right, a line a column with every carry written out, and states the
answer (``worked_sum``)::

    347+258: 7+8=15, 5
    34+25+1: 4+5+1=10, 05
    3+2+1: 3+2+1=6, 605
    #### 605

The model reads bytes, so the work is written at the grain a small transformer can learn: every digit a step needs
is next to something just written, never found by counting positions. Train and held-out problems
never share numbers (addition's terms taken as a set), and everything is a function of the seed.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import numpy as np

NAMES = ("Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ben", "Ivy", "Max", "Eva", "Noah", "Lily")
ITEMS = ("apples", "books", "coins", "stamps", "marbles", "cards", "shells", "pens", "beads", "stickers")
TWO_TERMS = (
    "{name} has {0} {items} and buys {1} more. How many {items} now?",
    "{name} had {0} {items}. A friend gave {name} {1} more. How many now?",
    "A box holds {0} {items} and another holds {1}. How many in all?",
    "{name} found {0} {items} on Monday and {1} on Tuesday. How many in all?",
)
THREE_TERMS = (
    "{name} has {0} {items}, buys {1} more, then finds {2}. How many now?",
    "Three boxes hold {0}, {1} and {2} {items}. How many {items} in all?",
    "{name} found {0} {items} on Monday, {1} on Tuesday and {2} on Friday. How many in all?",
)


@dataclass(frozen=True)
class Problem:
    prompt: str
    """The question, ending in a newline; it holds the numbers, never the answer."""
    reference: str
    """The worked solution, ending in ``#### N``."""
    answer: int
    terms: tuple[int, ...]

    def record(self) -> dict[str, str]:
        """The problem as a line of a prompt or evaluation file: ``prompt``, ``reference`` and ``answer``."""
        return {"prompt": self.prompt, "reference": self.reference, "answer": str(self.answer)}


def worked_sum(terms: tuple[int, ...]) -> str:
    """The column-by-column sum of ``terms``, a line a column from the right, ending in ``#### N``.

    Each line is what is left to add (the terms without the columns done, and the carry), then the column: its
    digits and carry, their sum, and the answer's digits so far. Every number a line needs sits at the end of a number
    just before it (a column's digits end the terms left; the carry and the digits so far are on the line above), so
    a small model finds them by looking nearby, not by counting positions::

        347+258: 7+8=15, 5
        34+25+1: 4+5+1=10, 05
        3+2+1: 3+2+1=6, 605
        #### 605
    """
    lines, carry, done = [], 0, ""
    left = [str(t) for t in terms]
    while left:
        parts = [int(t[-1]) for t in left] + ([carry] if carry else [])
        total = sum(parts)
        rest = [t[:-1] for t in left if len(t) > 1]
        done = (str(total) if not rest else str(total % 10)) + done
        lines.append(f"{'+'.join(left + ([str(carry)] if carry else []))}: {'+'.join(map(str, parts))}={total}, {done}")
        left, carry = rest, total // 10
    return "\n".join(lines) + f"\n#### {sum(terms)}"


@dataclass(frozen=True, kw_only=True)
class ArithmeticTask:
    """The task's recipe: everything its problems are a function of (a teacher trained on it is cached by it)."""

    seed: int = 0
    """Draws every number, name, item and template."""
    digits: int = 3
    """Digits of every term (its first one never 0)."""
    terms: int = 2
    """Numbers added in a problem: 2 or 3."""
    train_size: int = 20000
    """Training problems."""
    held_out_size: int = 500
    """Held-out problems: none shares its numbers with a training problem."""

    def __post_init__(self) -> None:
        from opsd_rollout import checks

        checks.integer("seed", self.seed, minimum=0)
        checks.integer("digits", self.digits, hint="1 to 6")
        if self.digits > 6:
            raise ValueError(f"digits must be an int in [1, 6]; got {self.digits!r}")
        checks.choice("terms", self.terms, (2, 3))
        checks.integer("train_size", self.train_size)
        checks.integer("held_out_size", self.held_out_size)
        low, high = 10 ** (self.digits - 1), 10 ** self.digits
        distinct = (high - low) ** self.terms // (2 if self.terms == 2 else 6)  # about, terms taken as a set
        if self.train_size + self.held_out_size > distinct // 2:
            raise ValueError(f"train_size + held_out_size ({self.train_size + self.held_out_size}) must be at most "
                             f"half the {distinct:,} or so distinct problems of {self.terms} {self.digits}-digit terms")

    def problems(self) -> tuple[tuple[Problem, ...], tuple[Problem, ...]]:
        """(train, held-out): distinct problems, in the order drawn; a problem's terms (as a set) belong to one split
        alone, chosen by a hash of them and the seed, so the splits never share a problem whatever the sizes. Made
        once per recipe in a process (a run asks for them several times: its teacher's name, its split, its eval
        file)."""
        return _problems(self)

    def _draw(self) -> tuple[tuple[Problem, ...], tuple[Problem, ...]]:
        rng = np.random.default_rng([self.seed, self.digits, self.terms])
        low, high = 10 ** (self.digits - 1), 10 ** self.digits
        train: list[Problem] = []
        held_out: list[Problem] = []
        seen: set[tuple[int, ...]] = set()
        while len(train) < self.train_size or len(held_out) < self.held_out_size:
            terms = tuple(int(t) for t in rng.integers(low, high, size=self.terms))
            key = tuple(sorted(terms))
            if key in seen:
                continue
            seen.add(key)
            split = held_out if self._held_out(key) else train
            if len(split) < (self.held_out_size if split is held_out else self.train_size):
                split.append(self._problem(terms, rng))
        return tuple(train), tuple(held_out)

    def _held_out(self, key: tuple[int, ...]) -> bool:
        """One set of terms in ten is held out, by a hash of it and the seed (stable across Pythons)."""
        digest = hashlib.sha256(f"{self.seed}:{key}".encode()).digest()
        return digest[0] % 10 == 0

    def _problem(self, terms: tuple[int, ...], rng: np.random.Generator) -> Problem:
        templates = TWO_TERMS if len(terms) == 2 else THREE_TERMS
        template = templates[int(rng.integers(len(templates)))]
        name, items = NAMES[int(rng.integers(len(NAMES)))], ITEMS[int(rng.integers(len(ITEMS)))]
        prompt = template.format(*terms, name=name, items=items) + "\n"
        return Problem(prompt, worked_sum(terms), sum(terms), terms)


@functools.lru_cache(maxsize=4)
def _problems(task: ArithmeticTask) -> tuple[tuple[Problem, ...], tuple[Problem, ...]]:
    return task._draw()
