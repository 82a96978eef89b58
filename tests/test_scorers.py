"""Task scorers: answers read from the datasets' own formats (GSM8K's ``####``, MATH's ``\\boxed{}``), the number
normalisation table, unextractable answers, the reference read as a worked solution or a bare answer, and the unbiased
pass@k against enumeration."""

from __future__ import annotations

import itertools

import pytest

from opsd_rollout.train.scorers import (SCORERS, extract, is_correct, normalize_number, pass_at_k,
                                         reference_answer)

GSM8K_ANSWER = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                "altogether in April and May.\n#### 72")
"""GSM8K's first training example's ``answer`` field, as the dataset writes it."""
MATH_SOLUTION = ("If $x = 2$, then $y = \\frac{1}{2}$, so the sum is $\\boxed{\\frac{5}{2}}$. Also "
                 "$\\boxed{\\frac{\\sqrt{3}}{2}}$ is the final answer.")


@pytest.mark.parametrize("text, expected", [
    ("72", "72"), ("1,234", "1234"), ("1,234,567", "1234567"), ("-3", "-3"), ("+3", "3"), ("3.0", "3"),
    ("3.50", "3.5"), ("0.5", "0.5"), (".5", "0.5"), ("-0", "0"), ("-0.0", "0"), ("$5", "5"), ("-$5.", "-5"),
    ("72.", "72"), (" 72 ", "72"), ("1{,}234", "1234"), ("1,\\!234", "1234"), ("\u22123", "-3"),
    ("1/2", "0.5"), ("2/4", "0.5"), ("6/3", "2"), ("2/3", "2/3"), ("4/6", "2/3"), ("-1/2", "-0.5"),
    ("\\frac{1}{2}", "0.5"), ("\\dfrac{3}{4}", "0.75"), ("\\frac12", "0.5"), ("-\\frac{2}{3}", "-2/3"),
    ("0.1", "0.1"), ("100", "100"), ("007", "7"),
])
def test_normalize_number_table(text, expected):
    assert normalize_number(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "1,2", "12,34", "3 apples", "1/0", "\\frac{1}{0}", "1.5/2", "--3",
                                  "1.2.3", "x"])
def test_normalize_number_refuses_what_is_not_one_number(text):
    assert normalize_number(text) is None


def test_equal_numbers_normalise_alike():
    spellings = ["0.5", "1/2", "\\frac{1}{2}", "2/4", "+0.50", "\\dfrac{1}{2}"]
    assert {normalize_number(s) for s in spellings} == {"0.5"}
    assert normalize_number("1/3") != normalize_number("0.333")  # a rounded decimal is not the fraction


# ---- gsm8k --------------------------------------------------------------------------------------------------------

def test_gsm8k_reads_the_datasets_own_answer():
    assert extract("gsm8k", GSM8K_ANSWER) == "72"
    assert reference_answer("gsm8k", GSM8K_ANSWER) == "72"


@pytest.mark.parametrize("completion, expected", [
    ("so 72 in all.\n#### 72", "72"),
    ("#### 72\n\nQuestion: Tom has 5 apples...\nAnswer: 5 - 2 = 3\n#### 3", "72"),  # the model's answer is the first
    ("#### 1,234", "1234"), ("#### $1,234.00", "1234"), ("#### -3", "-3"), ("####72.", "72"),
    ("#### 72 clips", "72"), ("#### 3.50", "3.5"),
])
def test_gsm8k_completions(completion, expected):
    assert extract("gsm8k", completion) == expected


@pytest.mark.parametrize("completion", ["The answer is 72", "#### seventy-two", "#### The answer is 72", "", "####"])
def test_gsm8k_unextractable(completion):
    assert extract("gsm8k", completion) is None
    assert is_correct("gsm8k", completion, GSM8K_ANSWER) is None


def test_gsm8k_reference_bare_or_solution():
    assert reference_answer("gsm8k", "72") == "72"
    assert reference_answer("gsm8k", "1,234") == "1234"
    assert reference_answer("gsm8k", "the answer is 72") is None  # neither GSM8K's format nor a bare number
    assert is_correct("gsm8k", "#### 72.0", "72") is True
    assert is_correct("gsm8k", "#### 71", GSM8K_ANSWER) is False


# ---- boxed --------------------------------------------------------------------------------------------------------

def test_boxed_reads_the_last_box_with_nested_braces():
    assert extract("boxed", MATH_SOLUTION) == "\\frac{\\sqrt{3}}{2}"
    assert extract("boxed", "so $\\boxed{\\frac{1}{2}}$.") == "0.5"
    assert extract("boxed", "\\boxed{\\dfrac{1}{2}}") == "0.5"


@pytest.mark.parametrize("completion, expected", [
    ("The answer is $\\boxed{5}$.", "5"), ("$\\boxed 5$", "5"), ("\\boxed 5", "5"), ("\\fbox{7}", "7"),
    ("\\boxed{1,\\!000}", "1000"), ("\\boxed{1{,}000}", "1000"), ("\\boxed{x = 5}", "5"), ("\\boxed{30^\\circ}", "30"),
    ("\\boxed{50\\%}", "50"), ("\\boxed{5\\text{ cm}}", "5"), ("\\boxed{\\text{(A)}}", "(A)"), ("\\boxed{3.0}", "3"),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)"), ("\\boxed{-\\frac{2}{3}}", "-2/3"), ("\\boxed{\\$18.90}", "18.9"),
])
def test_boxed_normalisation(completion, expected):
    assert extract("boxed", completion) == expected


@pytest.mark.parametrize("completion", ["no box here: 5", "\\boxed{\\frac{1}{2}", "\\boxed{}", "\\boxed{ }"])
def test_boxed_unextractable(completion):
    assert extract("boxed", completion) is None


def test_boxed_reference_bare_or_solution():
    assert reference_answer("boxed", "\\frac{5}{2}") == "2.5"  # MATH's 'answer' field: the bare answer
    assert reference_answer("boxed", "We get $\\boxed{\\frac{5}{2}}$.") == "2.5"  # its 'solution' field
    assert is_correct("boxed", "so $\\boxed{2.5}$", "\\frac{5}{2}") is True
    assert is_correct("boxed", "so $\\boxed{\\frac{5}{2}}$", "5/2") is True
    assert is_correct("boxed", "\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt 3}{2}") is False  # LaTeX not parsed
    assert is_correct("boxed", "\\boxed{\\frac{\\sqrt{3}}{2}}", "\\dfrac{\\sqrt{3}}{2}") is True
    assert is_correct("boxed", "\\boxed{033}", "33") is True  # AIME's three digits


# ---- last-number and exact ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, expected", [
    ("5 - 3 = 2", "2"), ("x = -3", "-3"), ("It costs $1,234.50.", "1234.5"), ("half: 1/2.", "0.5"),
    ("step2 gives 7 then x3", "7"), ("values 1, 2, 3", "3"), ("it is 1,234, not 5,67", "67"), ("3.14", "3.14"),
])
def test_last_number(completion, expected):
    assert extract("last-number", completion) == expected


def test_last_number_unextractable():
    assert extract("last-number", "no digits at all") is None
    assert is_correct("last-number", "none", "7") is None
    assert reference_answer("last-number", GSM8K_ANSWER) == "72"


@pytest.mark.parametrize("completion, reference, correct", [
    ("Paris", "Paris", True), ("  Paris.\nQuestion: and Spain?", "Paris", True), ("paris", "Paris", False),
    ("3.0", "3", True), ("1,000", "1000", True), ("Paris is the capital", "Paris", False), ("\n\n", "Paris", None),
])
def test_exact_first_line(completion, reference, correct):
    assert is_correct("exact", completion, reference) is correct


def test_every_scorer_is_known_and_unknown_ones_refused():
    assert SCORERS == ("gsm8k", "boxed", "last-number", "exact")
    with pytest.raises(ValueError, match="unknown scorer 'math'.*gsm8k, boxed, last-number, exact"):
        extract("math", "5")
    with pytest.raises(ValueError, match="holds no answer"):
        is_correct("gsm8k", "#### 5", "five")


# ---- pass@k -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_enumeration(n):
    """Over every draw of k of the n samples without replacement, the fraction holding a correct one."""
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            draws = list(itertools.combinations(outcomes, k))
            assert pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws), abs=1e-12)


def test_pass_at_k_reference_values():
    assert pass_at_k(16, 4, 1) == pytest.approx(4 / 16)  # pass@1 is c / n
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5)
    assert pass_at_k(1000, 0, 500) == 0.0 and pass_at_k(1000, 600, 500) == 1.0
    assert 0.0 < pass_at_k(10_000, 3, 5_000) < 1.0  # large n: a product, no overflow
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
