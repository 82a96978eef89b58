"""Side-by-side timing on a shared machine: every contender runs once per round, the order alternating from
round to round (so drift and a busy neighbour hit all alike), after unrecorded warm-up rounds; medians
compare. The developers' kernel benchmarks (``scripts/kernel_bench/contest.py``) time their rounds with the same two
pieces."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from opsd_rollout.profiling.clock import synchronize


def round_order(names: Sequence[str], index: int) -> list[str]:
    """The contenders' order in round ``index``: reversed in even rounds, as given in odd ones."""
    return list(names) if index % 2 else list(names)[::-1]


def timed(call: Callable[[], Any], device: torch.device, repeats: int = 1) -> tuple[float, Any]:
    """Wall-clock ms per call of ``repeats`` calls of ``call`` and what the last one returned; ``device`` is
    synchronized before and after (asynchronous work counts where it was launched)."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        result = call()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3 / repeats, result


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
    for round_ in range(warmup + rounds):
        for name in round_order(list(contenders), round_):
            if before_each is not None:
                before_each()
            ms, _ = timed(contenders[name], device)
            if round_ >= warmup:
                times[name].append(ms)
    return times


def interleaved_medians(contenders: Mapping[str, Callable[[], Any]], rounds: int, **kwargs: Any) -> dict[str, float]:
    """``interleaved_times``' median per contender."""
    return {name: statistics.median(values) for name, values in interleaved_times(contenders, rounds, **kwargs).items()}
