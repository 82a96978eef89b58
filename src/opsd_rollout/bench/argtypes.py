"""argparse types the benchmark scripts share (``scripts/*.py``): positive integers, alone or in a list."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_ints(text: str, separator: str = ",") -> list[int]:
    """argparse type: positive integers separated by ``separator`` (a comma list by default)."""
    try:
        return [positive_int(part) for part in text.split(separator)]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by {separator!r}, got {text!r}") \
            from None
