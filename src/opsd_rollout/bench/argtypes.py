"""argparse types the benchmark scripts share (``scripts/*.py``): positive integers, alone or in a list, from the
checks every config uses (``opsd_rollout.checks``)."""

from __future__ import annotations

import argparse

from opsd_rollout import checks

positive_int = checks.argument(checks.integer)
"""argparse type: a positive integer."""


def positive_ints(text: str, separator: str = ",") -> list[int]:
    """argparse type: positive integers separated by ``separator`` (a comma list by default)."""
    try:
        return [positive_int(part) for part in text.split(separator)]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by {separator!r}, got {text!r}") \
            from None
