"""A config's times adjusted for the machine's pace: what ``compare --pace adjusted`` judges when both files timed
the reference.

The runner times a fixed workload of plain torch ops beside every iteration (``bench/reference.py``, recorded as
``reference_ms``). A process that ran while the machine was slow (a neighbour on the VM's host contending for cache
or memory bandwidth, with no steal or load to show for it) is slow in both. Measured on this project's VM (issue 52,
RESULTS "The machine's pace"), the reference follows the config's time from process to process (rank correlation
0.7) but moves further (its processes 1.67 apart where the config's were 1.33), so dividing by it over-corrects and
widens the interval. What is done instead is an analysis of covariance in logs (the regression behind CUPED, the
covariate adjustment of online A/B tests): ``log y = a + d * after + theta * log x`` over both files' processes, the
change ``exp(d)`` with its t-interval, ``theta`` fitted (1 would be dividing, 0 the times as measured). The
reference's own ratio between the files says how far the machine moved. Alone (``--pace adjusted``) it flagged more
of a planted slowdown on fresh pairs, made after it was chosen, and added a false alarm; ``--pace both``, compare's
default, flags a metric only where the times as measured are a regression too.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import numpy as np

from opsd_rollout.bench.stats import median
from opsd_rollout.metrics import METRICS

if TYPE_CHECKING:
    from opsd_rollout.bench.report import ConfigResult

REFERENCE_METRIC = "reference_ms"
"""The iteration field the reference's time is recorded in."""
PACE_JUDGEMENTS = ("measured", "adjusted", "both")
"""What ``compare`` judges a time by (``--pace``): the times as measured, the times adjusted for the machine's pace
(``adjusted_ratio``), or both, a regression only where both find one."""
PACED_UNITS = {"ms": "time", "s": "time", "tokens/s": "rate"}
"""The units a machine's pace moves (the registry's): a slower machine makes times longer and rates lower; memory,
counts and ratios of times it leaves alone."""


def check_pace(pace: str) -> None:
    """Refuse a ``pace`` that is not one of ``PACE_JUDGEMENTS``, naming it."""
    if pace not in PACE_JUDGEMENTS:
        raise ValueError(f"pace: expected one of {', '.join(PACE_JUDGEMENTS)}; got {pace!r}")


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
    values, pace = result.process_medians(metric), result.process_medians(REFERENCE_METRIC)
    if len(values) != result.process_count or len(pace) != result.process_count or min(values + pace) <= 0:
        return None
    return list(zip(values, pace))


def adjusted_ratio(before: list[tuple[float, float]], after: list[tuple[float, float]],
                   confidence: float) -> tuple[float, float, float, float]:
    """AFTER / BEFORE adjusted for the machine's pace, its ``confidence`` interval and the slope ``theta``: the analysis
    of covariance ``log y = a + d * after + theta * log x`` fitted by least squares to both files' processes (each
    ``(median, reference median)``), the ratio ``exp(d)`` and the t-interval of ``d`` on ``n - 3`` degrees of
    freedom, which carries the fitted slope's uncertainty. A reference that does not vary leaves the plain t-interval
    of the two files' log medians (``theta`` 0). Too few processes for a degree of freedom: an unbounded interval."""
    rows = [(1.0, float(side), math.log(x), math.log(y)) for side, pairs in enumerate((before, after))
            for y, x in pairs]
    design = np.array([row[:3] for row in rows])
    logs = np.array([row[3] for row in rows])
    if not np.ptp(design[:, 2]):  # the reference did not vary: nothing to adjust by
        design = design[:, :2]
    dof = len(rows) - design.shape[1]
    if dof < 1 or min(len(before), len(after)) < 1:
        return float("nan"), 0.0, float("inf"), 0.0
    inverse = np.linalg.pinv(design.T @ design)
    coefficients = inverse @ design.T @ logs
    residual = logs - design @ coefficients
    error = math.sqrt(float(residual @ residual) / dof * inverse[1, 1])
    half = t_quantile(0.5 + confidence / 2, dof) * error
    change = float(coefficients[1])
    theta = float(coefficients[2]) if design.shape[1] == 3 else 0.0
    return math.exp(change), math.exp(change - half), math.exp(change + half), theta


@functools.lru_cache(maxsize=64)
def t_quantile(probability: float, dof: int) -> float:
    """Student's t quantile (``probability`` in (0.5, 1)) with ``dof`` degrees of freedom: its density integrated by
    Simpson's rule (on ``atan``'s scale, so the tail is finite) and the cumulative probability solved by bisection."""
    scale = math.exp(math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2)) / math.sqrt(dof * math.pi)

    def mass(upper: float) -> float:  # P(0 < T < upper); t = tan(u), dt = du / cos(u)^2
        steps = 400
        width = math.atan(upper) / steps
        total = 0.0
        for index in range(steps + 1):
            u = index * width
            weight = 1 if index in (0, steps) else 4 if index % 2 else 2
            total += weight * (1 + math.tan(u) ** 2 / dof) ** (-(dof + 1) / 2) / math.cos(u) ** 2
        return scale * total * width / 3

    target, low, high = probability - 0.5, 0.0, 1.0
    while mass(high) < target:
        high *= 2
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if mass(middle) < target else (low, middle)
    return (low + high) / 2


def machine_note(ratios: list[float], judged: str) -> str | None:
    """What the reference's ratio AFTER / BEFORE (one a config whose files both timed it, ``ratios``) says of the
    machine, and what the times were judged by (``judged``: ``measured``, ``adjusted`` or ``both``, as ``compare
    --pace`` was applied); ``None`` without a ratio."""
    if not ratios:
        return None
    ratios = sorted(ratios)
    middle = median(ratios)
    spread = f" ({ratios[0]:.2f}-{ratios[-1]:.2f} over the configs)" if len(ratios) > 1 else ""
    how = {"adjusted": "the times are adjusted for it (--pace adjusted): each process's median regressed on its "
                       "reference's",
           "both": "the times are judged as measured and adjusted for it (--pace both): a regression is one both "
                   "ways",
           "measured": "the times are judged as measured (--pace adjusted adjusts them for it, --pace both judges "
                       "both ways); a flag where the reference moved far is worth a rerun"}[judged]
    return (f"the machine's pace: the reference workload (fixed plain-torch work timed beside every iteration) took "
            f"{middle:.2f} times as long in AFTER as in BEFORE{spread}; {how}")
