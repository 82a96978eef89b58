"""A config's times relative to the machine's pace: what ``compare`` judges when both files timed the reference.

The runner times a fixed workload of plain torch ops beside every iteration (``bench/reference.py``, recorded as
``reference_ms``). A process that ran while the machine was slow (a neighbour on the VM's host contending for cache
or memory bandwidth, with no steal or load to show for it) is slow in both, so each process's median time over its
median reference time holds the code's cost and not the machine's moment; a throughput is multiplied by it. The
reference's own ratio between the files says how far the machine moved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opsd_rollout.bench.stats import median
from opsd_rollout.metrics import METRICS

if TYPE_CHECKING:
    from opsd_rollout.bench.report import ConfigResult

REFERENCE_METRIC = "reference_ms"
"""The iteration field the reference's time is recorded in."""
PACED_UNITS = {"ms": "time", "s": "time", "tokens/s": "rate"}
"""The units a machine's pace scales (the registry's): a slower machine makes times longer and rates lower; memory,
counts and ratios of times it leaves alone."""


def paced(metric: str) -> str | None:
    """How the machine's pace moves ``metric``: ``time``, ``rate``, or ``None`` (it does not, or it is the reference
    itself)."""
    if metric == REFERENCE_METRIC or metric not in METRICS:
        return None
    return PACED_UNITS.get(METRICS[metric].unit)


def paced_medians(result: ConfigResult, metric: str) -> list[float] | None:
    """Each process's median of ``metric`` relative to its median reference time (a time over it, a rate times it),
    in the order the processes ran; ``None`` when a process lacks either, or ``metric`` does not move with the
    machine's pace."""
    how = paced(metric)
    if how is None:
        return None
    out = []
    for iterations in result.per_process():
        values = [it[metric] for it in iterations if isinstance(it.get(metric), (int, float))]
        pace = [it[REFERENCE_METRIC] for it in iterations if isinstance(it.get(REFERENCE_METRIC), (int, float))]
        if not values or not pace or median(pace) <= 0:
            return None
        out.append(median(values) / median(pace) if how == "time" else median(values) * median(pace))
    return out


def machine_note(ratios: list[float]) -> str | None:
    """What the reference's ratio AFTER / BEFORE (one a compared config, ``ratios``) says of the machine; ``None``
    when no config was judged relative to it."""
    if not ratios:
        return None
    ratios = sorted(ratios)
    middle = median(ratios)
    spread = f" ({ratios[0]:.2f}-{ratios[-1]:.2f} over the configs)" if len(ratios) > 1 else ""
    return (f"times are judged relative to the machine's pace: each process's median over its reference workload's "
            f"(fixed plain-torch work timed beside every iteration), which took {middle:.2f} times as long in AFTER "
            f"as in BEFORE{spread}; --ignore-reference judges the times as measured")
