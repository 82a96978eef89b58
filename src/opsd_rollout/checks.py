"""One way to check a value: one function per kind of check, used alike by every config's ``__post_init__``, the
bench's settings and axes, and the command line's argument types (``argument``).

Each raises ``ValueError`` (``TypeError`` for a value of the wrong type where a config takes it from code)
with the argument's name, what was expected and the value given, and returns the value.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def boolean(name: str, value: Any) -> bool:
    """A bool (not 0/1: a config's flag given a number is a mistake worth a message)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {value!r}")
    return value


def integer(name: str, value: Any, *, minimum: int = 1, optional: bool = False) -> int | None:
    """An int ``>= minimum`` (``None`` too when ``optional``); a bool is not an int here."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{' or None' if optional else ''}; got {value!r}")
    return value


def number(name: str, value: Any, *, above: float | None = None, at_least: float | None = None,
           at_most: float | None = None, optional: bool = False) -> float | None:
    """A finite real number within the bounds given (``above`` exclusive, ``at_least``/``at_most`` inclusive)."""
    if value is None and optional:
        return None
    bounds = [f"> {above}" if above is not None else "", f">= {at_least}" if at_least is not None else "",
              f"<= {at_most}" if at_most is not None else ""]
    expected = " and ".join(b for b in bounds if b)
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
          and (above is None or value > above) and (at_least is None or value >= at_least)
          and (at_most is None or value <= at_most))
    if not ok:
        raise ValueError(f"{name} must be a finite number{' ' + expected if expected else ''}"
                         f"{' or None' if optional else ''}; got {value!r}")
    return float(value)


def choice(name: str, value: Any, choices: Sequence[T]) -> T:
    """One of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}; got {value!r}")
    return value


def argument(check: Callable[..., Any], convert: Callable[[str], Any] = int, **bounds: Any) -> Callable[[str], Any]:
    """An argparse ``type`` from a check: ``convert`` the text, then ``check`` it; argparse prints the message
    under the flag's name."""
    def parse(text: str) -> Any:
        try:
            return check("the value", convert(text), **bounds)
        except (TypeError, ValueError) as error:
            message = str(error) if "must be" in str(error) else f"expected {convert.__name__}; got {text!r}"
            raise argparse.ArgumentTypeError(message.replace("the value must be", "expected")) from None

    parse.__name__ = check.__name__
    return parse


def on_off(text: str) -> bool:
    """argparse type: ``on`` or ``off``."""
    value = text.strip().lower()
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off; got {text!r}")
    return value == "on"
