"""The built-in arithmetic task (``--task arithmetic``): problems made from a seed, splits that never share a problem,
worked solutions whose every step and ``####`` answer is the arithmetic's, prompts that hold no answer, and the
references trained with an EOS after them."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opsd_rollout.models import EOS_ID, byte_tokenizer
from opsd_rollout.train.data import Encoder, Example
from opsd_rollout.train.tasks import TASKS, task_examples
from opsd_rollout.train.tasks.arithmetic import ArithmeticTask, worked_sum

SMALL = dict(train_size=300, held_out_size=40)


def check_worked_sum(terms: tuple[int, ...], reference: str) -> None:
    """Every line of ``reference`` against ``terms``, worked out here again: what is left to add (the terms without
    the columns done, then the carry), the column's digits and carry, their sum, the answer's digits so far; then
    ``#### N`` with N the sum."""
    *lines, last = reference.split("\n")
    assert last == f"#### {sum(terms)}", reference
    left, carry, done = [str(t) for t in terms], 0, ""
    for line in lines:
        match = re.fullmatch(r"([\d+]+): ([\d+]+)=(\d+), (\d+)", line)
        assert match, (reference, line)
        remaining, column, total, so_far = match.groups()
        assert remaining.split("+") == left + ([str(carry)] if carry else []), (reference, line)
        assert [int(d) for d in column.split("+")] == [int(t[-1]) for t in left] + ([carry] if carry else [])
        assert int(total) == sum(int(d) for d in column.split("+")), (reference, line)
        left = [t[:-1] for t in left if len(t) > 1]
        done = (total if not left else str(int(total) % 10)) + done
        assert so_far == done, (reference, line)
        carry = int(total) // 10
    assert not left and int(done) == sum(terms), reference


def test_the_same_seed_makes_the_same_problems_and_another_seed_others():
    first, again = ArithmeticTask(seed=3, **SMALL).problems(), ArithmeticTask(seed=3, **SMALL)._draw()
    assert first == again  # drawn again, not the process's cached copy
    other = ArithmeticTask(seed=4, **SMALL).problems()
    assert {p.terms for p in other[0]} != {p.terms for p in first[0]}


@pytest.mark.parametrize("terms", [2, 3])
def test_the_splits_never_share_a_problem_and_have_their_sizes(terms):
    train, held_out = ArithmeticTask(terms=terms, **SMALL).problems()
    assert (len(train), len(held_out)) == (300, 40)
    as_sets = [{tuple(sorted(p.terms)) for p in split} for split in (train, held_out)]
    assert len(as_sets[0]) == 300 and len(as_sets[1]) == 40  # no problem twice in a split, in any order
    assert not as_sets[0] & as_sets[1]
    assert not {p.prompt for p in train} & {p.prompt for p in held_out}


def test_a_problem_keeps_its_split_whatever_the_sizes():
    small, large = ArithmeticTask(**SMALL).problems(), ArithmeticTask(train_size=600, held_out_size=80).problems()
    held_out_of_large = {p.terms for p in large[1]}
    assert not {p.terms for p in small[0]} & held_out_of_large  # a held-out problem never trains in a smaller task


@pytest.mark.parametrize("digits,terms", [(3, 2), (3, 3), (2, 2), (4, 2)])
def test_every_worked_step_and_answer_is_right_and_the_prompt_holds_only_the_terms(digits, terms):
    train, held_out = ArithmeticTask(digits=digits, terms=terms, **SMALL).problems()
    for problem in train + held_out:
        assert problem.answer == sum(problem.terms)
        assert all(len(str(t)) == digits for t in problem.terms)
        check_worked_sum(problem.terms, problem.reference)
        assert tuple(int(n) for n in re.findall(r"\d+", problem.prompt)) == problem.terms  # no answer, no step
        assert problem.prompt.endswith("?\n")
        assert problem.record() == {"prompt": problem.prompt, "reference": problem.reference,
                                    "answer": str(problem.answer)}


@given(st.lists(st.integers(0, 10**6), min_size=2, max_size=4))
def test_worked_sums_of_any_terms_are_right(terms):
    check_worked_sum(tuple(terms), worked_sum(tuple(terms)))


def test_carries_are_written_out():
    assert worked_sum((347, 258)) == "347+258: 7+8=15, 5\n34+25+1: 4+5+1=10, 05\n3+2+1: 3+2+1=6, 605\n#### 605"
    assert worked_sum((999, 999, 999)) == ("999+999+999: 9+9+9=27, 7\n99+99+99+2: 9+9+9+2=29, 97\n"
                                          "9+9+9+2: 9+9+9+2=29, 2997\n#### 2997")


@pytest.mark.parametrize("change,message", [
    (dict(digits=0), "digits must be an int"), (dict(digits=7), r"digits must be an int in \[1, 6\]"),
    (dict(terms=4), "terms must be one of"), (dict(train_size=0), "train_size must be an int"),
    (dict(digits=1, train_size=30), "must be at most half"),
])
def test_bad_recipes_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        ArithmeticTask(**{**SMALL, **change})


def test_the_tasks_examples_train_an_eos_after_each_worked_solution(monkeypatch):
    monkeypatch.setitem(TASKS, "arithmetic", ArithmeticTask(**SMALL))
    train, held_out = task_examples("arithmetic")
    assert len(train) == 300 and all(e.eos and e.reference.endswith(f"#### {e.reference.split()[-1]}") for e in train)
    encoder = Encoder(byte_tokenizer(), max_prompt_tokens=256, max_reference_tokens=128)
    window = Example("a window", "of running text", eos=False)
    batch = encoder.with_references(train[:2] + [window], torch.device("cpu"))
    start = batch.response_start_idx[0]
    for row, example in zip(range(3), train[:2] + [None]):
        tokens = batch.input_ids[row, start:][batch.attention_mask[row, start:].bool()].tolist()
        if example is None:  # a reference that is not a whole response gets no EOS
            assert EOS_ID not in tokens
        else:
            assert tokens[-1] == EOS_ID and byte_tokenizer().decode(tokens[:-1]) == example.reference
