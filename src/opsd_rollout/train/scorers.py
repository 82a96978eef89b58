"""Task scorers: small pure functions from a model's text to its final answer, as lm-evaluation-harness writes them.

``extract(scorer, text)`` is the answer a completion gives, normalised, or ``None`` when it gives none (counted
apart, and wrong); ``is_correct(scorer, completion, reference)`` compares it with the reference's answer.

Scorers (``SCORERS``):
- ``gsm8k``: the number after the first ``####`` (GSM8K's solutions end ``#### 72``; what a model writes after its
  answer, such as a next question of its own with another ``####``, is not its answer);
- ``boxed``: the content of the last ``\\boxed{...}`` (nested braces kept, ``\\boxed 5`` and ``\\fbox{...}`` read
  too), as MATH and AIME solutions write it;
- ``last-number``: the last number in the text;
- ``exact``: the first non-empty line, whole (a short answer; the first line because a model that answers goes on
  to write more, as lm-evaluation-harness stops generation at a newline for such tasks).

Numbers are normalised (``normalize_number``) wherever a scorer finds one: thousands commas (``1,234`` and LaTeX's
``1{,}234``, ``1,\\!234``), a leading ``+``, ``$`` signs, a trailing ``.``, trailing zeros (``3.0`` = ``3``,
``3.50`` = ``3.5``), and exact fractions (``1/2`` = ``\\frac{1}{2}`` = ``0.5``; ``2/3`` stays ``2/3``): two
answers are equal when they are the same rational number. A ``boxed`` answer that is not a number is compared as
LaTeX with spacing, ``\\left``/``\\right``, ``\\dfrac``, ``\\text{}`` and a one-letter ``x =`` removed.

The reference answer (``reference_answer``): the scorer's extraction when the reference is itself a worked
solution (a GSM8K ``answer`` ending ``#### 72``, a MATH solution with its ``\\boxed{}``), else the reference taken
whole as the bare answer (``72``, ``\\frac{1}{2}``), normalised the same way; ``None`` when neither gives an answer
the scorer can compare (a ``gsm8k`` or ``last-number`` reference that holds no number).
"""

from __future__ import annotations

import re
from decimal import Decimal
from fractions import Fraction

SCORERS = ("gsm8k", "boxed", "last-number", "exact")

_NUMBER = re.compile(
    r"(?<![A-Za-z0-9_.])[-+]?(?:\d{1,3}(?:,\d{3})+(?!\d|,\d)|\d+)(?:\.\d+)?(?:/\d+(?!\d|\.\d))?"
    r"|(?<![A-Za-z0-9_.])[-+]?\.\d+")
"""A number in free text: an optional sign, digits (thousands grouped by commas, or none), an optional decimal
part, or an integer fraction ``a/b``; not the digits of a word (``x2``) nor a number's own tail."""
_WHOLE_NUMBER = re.compile(r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)")
_FRAC = re.compile(r"([-+]?)\\frac(?:\{\s*([-+]?\d+)\s*\}|(\d))(?:\{\s*([-+]?\d+)\s*\}|(\d))")
_SPACING = re.compile(r"\\[!,;: ]|\\quad|\\qquad|\\left|\\right|\\displaystyle")
_UNIT = re.compile(r"\\text\s*\{\s[^{}]*\}")
"""``\\text{ cm}``: a unit after the answer (text that opens with a space), dropped as MATH's grader drops it."""
_TEXT = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox)\s*\{([^{}]*)\}")
_DEGREES = re.compile(r"\^\s*\{?\\circ\}?")
_VARIABLE = re.compile(r"^[A-Za-z]\s*=(?!=)")


def _clean(text: str) -> str:
    """What never changes a number's value: LaTeX's thin spaces and ``{,}``, dollar signs, a Unicode minus."""
    return (text.replace("\\!", "").replace("{,}", ",").replace("\\$", "").replace("$", "")
            .replace("\u2212", "-"))


def _format(value: Fraction) -> str:
    """A rational number written once: an integer, a terminating decimal without trailing zeros, or ``p/q``."""
    if value.denominator == 1:
        return str(value.numerator)
    rest = value.denominator
    for prime in (2, 5):
        while rest % prime == 0:
            rest //= prime
    if rest != 1:
        return f"{value.numerator}/{value.denominator}"
    digits = Decimal(value.numerator) / Decimal(value.denominator)  # exact: the denominator is 2^a 5^b
    return format(digits.normalize(), "f")


def _fraction(text: str) -> Fraction | None:
    """The rational number ``text`` spells whole (a decimal, ``a/b``, ``\\frac{a}{b}``), else ``None``."""
    frac = _FRAC.fullmatch(text)
    if frac:
        sign, top, bottom = frac[1], frac[2] or frac[3], frac[4] or frac[5]
        return None if int(bottom) == 0 else Fraction(int(top), int(bottom)) * (-1 if sign == "-" else 1)
    top, slash, bottom = text.partition("/")
    if slash:
        if not (_WHOLE_NUMBER.fullmatch(top) and bottom.isdigit()) or int(bottom) == 0 or "." in top:
            return None
        return Fraction(int(top.replace(",", "")), int(bottom))
    if not _WHOLE_NUMBER.fullmatch(text):
        return None
    return Fraction(Decimal(text.replace(",", "")))


def normalize_number(text: str) -> str | None:
    """``text`` as one canonical number (``"1,234"`` -> ``"1234"``, ``"+3.50"`` -> ``"3.5"``, ``"3.0"`` -> ``"3"``,
    ``"\\frac{1}{2}"`` and ``"2/4"`` -> ``"0.5"``, ``"-$5."`` -> ``"-5"``), or ``None`` when it is not exactly one
    number (``"1,2"``, ``"3 apples"``, ``"1/0"``)."""
    text = re.sub(r"\s+", "", _clean(text)).removesuffix(".")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    if not text:
        return None
    value = _fraction(text)
    return None if value is None else _format(value)


def _numbers(text: str) -> list[str]:
    """Every number in free text, normalised, in order."""
    found = (normalize_number(match) for match in _NUMBER.findall(_clean(text)))
    return [number for number in found if number is not None]


def _braced(text: str, start: int) -> str | None:
    """The content of the brace group opening at ``text[start]`` (nested groups kept), or ``None`` when it is
    never closed (a generation cut short)."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i]
    return None


def last_boxed(text: str) -> str | None:
    """The raw content of the last ``\\boxed{...}`` or ``\\fbox{...}`` (``\\boxed 5``: the token after the
    space), or ``None``."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if text.startswith("{", rest):
        return _braced(text, rest)
    if rest < len(text) and text[rest] == " ":
        token = re.match(r"\s*([^\s$]+)", text[rest:])
        return token[1] if token else None
    return None


def normalize_math(text: str) -> str | None:
    """A LaTeX answer written once: a number as ``normalize_number`` writes it, else the LaTeX with spacing,
    ``\\left``/``\\right``, ``\\text{}`` wrappers, degrees, ``\\%``, ``$`` and a one-letter ``x =`` removed and
    ``\\dfrac``/``\\tfrac`` read as ``\\frac``; ``None`` when nothing is left."""
    text = _TEXT.sub(r"\1", _UNIT.sub("", _SPACING.sub("", _clean(text))))
    text = _DEGREES.sub("", text).replace("\\%", "").replace("%", "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = _VARIABLE.sub("", re.sub(r"\s+", "", text)).removesuffix(".")
    if not text:
        return None
    return normalize_number(text) or text


def _first_line(text: str) -> str | None:
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    line = line.removesuffix(".").strip()
    if not line:
        return None
    return normalize_number(line) or line


def _gsm8k(text: str) -> str | None:
    _, marker, tail = text.partition("####")
    number = _NUMBER.match(_clean(tail).lstrip()) if marker else None  # the answer right after the marker
    return None if number is None else normalize_number(number[0])


def _boxed(text: str) -> str | None:
    content = last_boxed(text)
    return None if content is None else normalize_math(content)


def _last_number(text: str) -> str | None:
    numbers = _numbers(text)
    return numbers[-1] if numbers else None


_EXTRACTORS = {"gsm8k": _gsm8k, "boxed": _boxed, "last-number": _last_number, "exact": _first_line}
_BARE = {"gsm8k": normalize_number, "boxed": normalize_math, "last-number": normalize_number, "exact": _first_line}


def check_scorer(scorer: str) -> str:
    if scorer not in SCORERS:
        raise ValueError(f"unknown scorer {scorer!r}; known: {', '.join(SCORERS)}")
    return scorer


def extract(scorer: str, text: str) -> str | None:
    """The normalised answer ``text`` gives under ``scorer``, or ``None`` when it gives none."""
    return _EXTRACTORS[check_scorer(scorer)](text)


def reference_answer(scorer: str, reference: str) -> str | None:
    """The reference's answer: the scorer's extraction when it is a worked solution, else the reference whole as
    the bare answer (see the module docstring); ``None`` when it holds none the scorer can compare."""
    answer = extract(scorer, reference)
    return answer if answer is not None else _BARE[scorer](reference)


def is_correct(scorer: str, completion: str, reference: str) -> bool | None:
    """Whether ``completion``'s answer is the reference's; ``None`` when the completion gives no answer (wrong,
    and counted apart). A reference with no answer is a ``ValueError``: the eval file is checked for that."""
    expected = reference_answer(scorer, reference)
    if expected is None:
        raise ValueError(f"reference {reference!r} holds no answer the {scorer} scorer can read")
    answer = extract(scorer, completion)
    return None if answer is None else answer == expected


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem with ``c`` correct of ``n`` samples (Chen et al. 2021): the chance that
    ``k`` of the ``n`` drawn without replacement hold a correct one, ``1 - C(n-c, k) / C(n, k)``, computed as a
    product (no huge binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    missed = 1.0
    for i in range(n - c + 1, n + 1):
        missed *= 1.0 - k / i
    return 1.0 - missed
