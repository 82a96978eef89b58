"""A config's times adjusted for the machine's pace: what ``compare --adjust-for-pace`` judges when both files timed
the reference.

The runner times a fixed workload of plain torch ops beside every iteration (``bench/reference.py``, recorded as
``reference_ms``). A process that ran while the machine was slow (a neighbour on the VM's host contending for cache
or memory bandwidth, with no steal or load to show for it) is slow in both. Measured on this project's VM (issue 52,
RESULTS "The machine's pace"), the reference follows the config's time from process to process (rank correlation
0.7) but moves further (its processes 1.67 apart where the config's were 1.33), so dividing by it over-corrects and
widens the interval. What is done instead is the covariate adjustment of A/B tests (CUPED, Deng et al. 2013), in
logs: each process's log median minus ``theta`` times its log reference's distance from the mean of both files',
``theta`` the slope of the one on the other across the processes, estimated inside each file (each centred on its
own mean, so a change of code between the files does not leak into it) and pooled. A slope of 1 is dividing; of 0,
the times as measured. The reference's own ratio between the files says how far the machine moved. Not the default:
on runs it had not been chosen on (the step bench's same-code pairs) it narrowed the interval and added a false alarm,
its interval not carrying the uncertainty of the fitted slope.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from opsd_rollout.bench.stats import median
from opsd_rollout.metrics import METRICS

if TYPE_CHECKING:
    from opsd_rollout.bench.report import ConfigResult

REFERENCE_METRIC = "reference_ms"
"""The iteration field the reference's time is recorded in."""
PACED_UNITS = {"ms": "time", "s": "time", "tokens/s": "rate"}
"""The units a machine's pace moves (the registry's): a slower machine makes times longer and rates lower; memory,
counts and ratios of times it leaves alone."""


def paced(metric: str) -> str | None:
    """How the machine's pace moves ``metric``: ``time``, ``rate``, or ``None`` (it does not, or it is the reference
    itself)."""
    if metric == REFERENCE_METRIC or metric not in METRICS:
        return None
    return PACED_UNITS.get(METRICS[metric].unit)


def paced_medians(result: ConfigResult, metric: str) -> list[tuple[float, float]] | None:
    """Each process's median of ``metric`` and its median reference time, in the order the processes ran; ``None``
    when a process lacks either (or a positive value), or ``metric`` does not move with the machine's pace."""
    if paced(metric) is None:
        return None
    out = []
    for iterations in result.per_process():
        values = [it[metric] for it in iterations if isinstance(it.get(metric), (int, float))]
        pace = [it[REFERENCE_METRIC] for it in iterations if isinstance(it.get(REFERENCE_METRIC), (int, float))]
        if not values or not pace or min(median(values), median(pace)) <= 0:
            return None
        out.append((median(values), median(pace)))
    return out


def adjusted(before: list[tuple[float, float]],
             after: list[tuple[float, float]]) -> tuple[list[float], list[float], float]:
    """BEFORE's and AFTER's processes' figures (each ``(median, reference median)``) adjusted to the mean reference of
    both files, and the slope ``theta`` used: ``exp(log y - theta * (log x - mean log x))``, ``theta`` the pooled
    within-file least-squares slope of ``log y`` on ``log x`` (0 when no file's reference varies)."""
    logs = [[(math.log(y), math.log(x)) for y, x in side] for side in (before, after)]
    covariance = variance = 0.0
    for side in logs:
        mean_y, mean_x = (sum(v[i] for v in side) / len(side) for i in (0, 1))
        covariance += sum((x - mean_x) * (y - mean_y) for y, x in side)
        variance += sum((x - mean_x) ** 2 for _, x in side)
    theta = covariance / variance if variance > 0 else 0.0
    centre = sum(x for side in logs for _, x in side) / sum(len(side) for side in logs)
    a, b = ([math.exp(y - theta * (x - centre)) for y, x in side] for side in logs)
    return a, b, theta


def machine_note(ratios: list[float], applied: bool) -> str | None:
    """What the reference's ratio AFTER / BEFORE (one a config whose files both timed it, ``ratios``) says of the
    machine, and whether the figures were adjusted for it (``applied``); ``None`` without a ratio."""
    if not ratios:
        return None
    ratios = sorted(ratios)
    middle = median(ratios)
    spread = f" ({ratios[0]:.2f}-{ratios[-1]:.2f} over the configs)" if len(ratios) > 1 else ""
    how = ("the times are adjusted for it (--adjust-for-pace): each process's median regressed on its reference's"
           if applied else "the times are judged as measured (--adjust-for-pace adjusts them for it); a flag where "
           "the reference moved far is worth a rerun")
    return (f"the machine's pace: the reference workload (fixed plain-torch work timed beside every iteration) took "
            f"{middle:.2f} times as long in AFTER as in BEFORE{spread}; {how}")
