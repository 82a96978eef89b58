"""Side-by-side timing on a shared machine: every contender runs once per round, the order alternating from
round to round (so drift and a busy neighbour hit all alike), after unrecorded warm-up rounds; medians
compare. The one helper the comparison scripts share."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from opsd_rollout.profiling.clock import synchronize


def interleaved_times(contenders: Mapping[str, Callable[[], Any]], rounds: int, *, warmup: int = 1,
                      device: torch.device | str | None = None,
                      before_each: Callable[[], Any] | None = None) -> dict[str, list[float]]:
    """Wall-clock ms of each contender's call, ``rounds`` times each after ``warmup`` unrecorded rounds.

    ``device`` is synchronized before and after every call (asynchronous work counts where it was launched);
    ``before_each`` runs untimed before every call (e.g. a barrier, so ranks start together)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1; got {rounds}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for round_ in range(warmup + rounds):
        for name in (names if round_ % 2 else names[::-1]):
            if before_each is not None:
                before_each()
            synchronize(device)
            start = time.perf_counter()
            contenders[name]()
            synchronize(device)
            if round_ >= warmup:
                times[name].append((time.perf_counter() - start) * 1e3)
    return times


def interleaved_medians(contenders: Mapping[str, Callable[[], Any]], rounds: int, **kwargs: Any) -> dict[str, float]:
    """``interleaved_times``' median per contender."""
    return {name: statistics.median(values) for name, values in interleaved_times(contenders, rounds, **kwargs).items()}
