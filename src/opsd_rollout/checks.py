"""One way to check a value: one function per kind of check, used alike by every config's ``__post_init__``, the
rollout's input checks, the bench's settings and matrix axes, and the command line's argument types.

Each takes the argument's name and its value, returns the value, and raises ``ValueError`` (``TypeError`` for a
flag that is not a bool) naming the argument, what was expected and what was given. ``rule`` turns a check into
a settings rule, ``argument`` into an argparse type, ``from_text`` reads a number a flag or a file gave as text.
``quoted`` shows a value read from a JSON file in a message, as JSON spells it and shortened.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

ON = ("on", "true", "yes", "1")
OFF = ("off", "false", "no", "0")


def boolean(name: str, value: Any) -> bool:
    """A bool (not 0/1: a config's flag given a number is a mistake worth a message)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {value!r}")
    return value


def integer(name: str, value: Any, *, minimum: int | None = 1, optional: bool = False, hint: str = "") -> Any:
    """An int ``>= minimum`` (any int when ``minimum`` is ``None``; ``None`` too when ``optional``); a bool is
    not an int here."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ValueError(f"{name} must be an int{bound}{f' ({hint})' if hint else ''}{' or None' if optional else ''}; "
                         f"got {value!r}")
    return value


def _expected(above: float | None, at_least: float | None, at_most: float | None, below: float | None) -> str:
    low = f"({above:g}" if above is not None else f"[{at_least:g}" if at_least is not None else None
    high = f"{at_most:g}]" if at_most is not None else f"{below:g})" if below is not None else None
    if low and high:
        return f"in {low}, {high}"
    if low:
        return f"a number > {above:g}" if above is not None else f"a number >= {at_least:g}"
    if high:
        return f"a number <= {at_most:g}" if at_most is not None else f"a number < {below:g}"
    return "a finite number"


def number(name: str, value: Any, *, above: float | None = None, at_least: float | None = None,
           at_most: float | None = None, below: float | None = None, optional: bool = False,
           hint: str = "") -> Any:
    """A finite real number within the bounds given (``above``/``below`` exclusive, ``at_least``/``at_most``
    inclusive)."""
    if value is None and optional:
        return None
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
          and (above is None or value > above) and (at_least is None or value >= at_least)
          and (at_most is None or value <= at_most) and (below is None or value < below))
    if not ok:
        raise ValueError(f"{name} must be {_expected(above, at_least, at_most, below)}"
                         f"{f' ({hint})' if hint else ''}{' or None' if optional else ''}; got {value!r}")
    return value


def choice(name: str, value: Any, choices: Sequence[T]) -> T:
    """One of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}; got {value!r}")
    return value


def text(name: str, value: Any, *, what: str = "a non-empty string") -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be {what}; got {value!r}")
    return value


def on_off(name: str, value: Any) -> bool:
    """``on``/``off`` as a flag or a file gives it (true/false, yes/no, 1/0, or a bool)."""
    if isinstance(value, bool):
        return value
    spelled = str(value).strip().lower()
    if spelled not in ON + OFF:
        raise ValueError(f"{name} must be on or off; got {value!r}")
    return spelled in ON


def from_text(value: Any, kind: type) -> Any:
    """``value`` as an int or a float when it is that number spelled as text (a flag, a config file); anything
    else as it is, for the check to refuse."""
    if isinstance(value, str):
        try:
            return kind(value.strip())
        except ValueError:
            return value
    return value


def quoted(value: Any, limit: int = 60) -> str:
    """A value read from a JSON file (a config, a line of a data file) as a message quotes it: as JSON spells it
    (``"three"``, ``true``, ``null``; other values by ``repr``), cut to ``limit`` characters."""
    text = json.dumps(value) if isinstance(value, (str, bool)) or value is None else repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def rule(check: Callable[..., Any], **bounds: Any) -> Callable[[str, Any], Any]:
    """A settings rule: ``rule(integer, minimum=0)(name, value)``."""
    return functools.partial(check, **bounds)


def failures(rules: dict[str, Callable[[str, Any], Any]], owner: Any) -> list[str]:
    """Every rule ``owner``'s attributes break, one message each."""
    errors = []
    for name, check in rules.items():
        try:
            check(name, getattr(owner, name))
        except (TypeError, ValueError) as error:
            errors.append(str(error))
    return errors


def argument(check: Callable[..., Any], kind: type = int, **bounds: Any) -> Callable[[str], Any]:
    """An argparse ``type`` from a check: read the text as ``kind``, then ``check`` it; argparse prints the
    message under the flag's name."""
    def parse(value: str) -> Any:
        try:
            return check("the value", from_text(value, kind), **bounds)
        except (TypeError, ValueError) as error:
            raise argparse.ArgumentTypeError(str(error).replace("the value must be", "expected")) from None

    parse.__name__ = check.__name__  # argparse names the type in its message
    return parse
