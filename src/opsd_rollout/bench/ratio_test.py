"""How much slower (or faster) AFTER is than BEFORE, from a few iterations of each: the Hodges-Lehmann
estimate of the ratio and its distribution-free confidence interval (Moses), on log values.

Why this test: a config's iterations on a CPU are skewed and now and then one is an outlier, and a benchmark
takes 5 to 10 of them. A bootstrap of the medians of 5 values resamples a handful of distinct medians, so its
interval is as wide as the samples' extremes (a planted 1.5x slowdown read 0.99-2.28). The rank test uses
every pair instead: on log times a slowdown is a shift, the estimate is the median of the log ratios of every
AFTER iteration to every BEFORE one, and the interval is read off those sorted log ratios at ranks given by the
Mann-Whitney statistic's exact distribution. It assumes nothing of the times' distribution beyond independent
iterations of one shape on each side, an outlier moves it by one rank, and 5 iterations per side that do not
overlap (a 1.5x slowdown with a few percent of noise) give an interval that excludes 1 by far.
"""

from __future__ import annotations

import math
from functools import lru_cache
from statistics import NormalDist

import numpy as np

EXACT_LIMIT = 2500
"""Up to this many pairs (iterations before x after) the Mann-Whitney distribution is counted exactly; beyond,
its normal approximation is already exact to the rank."""


@lru_cache(maxsize=64)
def _u_counts(m: int, n: int) -> tuple[int, ...]:
    """How many orderings of ``m`` BEFORE and ``n`` AFTER values give each Mann-Whitney U, 0 to ``m * n``: the
    coefficients of the Gaussian binomial ``[m + n, m]``. Python integers: the product below subtracts, which
    floats would round."""
    size = m * n + 1
    counts = [1] + [0] * (size - 1)
    for i in range(1, m + 1):
        shift = n + i
        for k in range(size - 1, shift - 1, -1):  # times (1 - q^(n+i)), descending: reads the old values
            counts[k] -= counts[k - shift]
        for k in range(i, size):  # divided by (1 - q^i), ascending: reads the new ones
            counts[k] += counts[k - i]
    return tuple(counts)


def tail_rank(m: int, n: int, confidence: float) -> int:
    """The number ``k`` of pairwise differences cut from each end of their sorted list for a two-sided
    ``confidence`` interval: the largest ``k`` with P(U < k) <= (1 - confidence) / 2. 0: these few iterations
    cannot reach ``confidence`` (the interval is unbounded)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1); got {confidence}")
    if m < 1 or n < 1:
        raise ValueError(f"each side needs at least one value; got {m} and {n}")
    alpha = (1 - confidence) / 2
    if m * n > EXACT_LIMIT:
        sd = math.sqrt(m * n * (m + n + 1) / 12)
        return max(0, math.floor(m * n / 2 + 0.5 - NormalDist().inv_cdf(1 - alpha) * sd))
    counts, total = _u_counts(m, n), math.comb(m + n, m)
    below, k = 0, 0
    while below + counts[k] <= alpha * total:  # P(U <= k) still within the tail
        below += counts[k]
        k += 1
    return k


def fewest_iterations(confidence: float) -> int:
    """The fewest iterations per side (the same on both) with which the test can reach ``confidence``."""
    n = 1
    while tail_rank(n, n, confidence) == 0:
        n += 1
    return n


def ratio_interval(before: list[float], after: list[float], confidence: float) -> tuple[float, float, float]:
    """``(ratio, low, high)``: the Hodges-Lehmann estimate of after / before (the median ratio over every pair
    of a BEFORE and an AFTER value) and its ``confidence`` interval; ``(ratio, 0, inf)`` when too few values
    to bound it. Values must be positive (log ratios)."""
    a, b = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
    if len(a) == 0 or len(b) == 0 or (a <= 0).any() or (b <= 0).any():
        raise ValueError(f"ratio_interval needs positive values on both sides; got {list(before)} and {list(after)}")
    differences = np.sort((np.log(b)[None, :] - np.log(a)[:, None]).ravel())
    ratio = float(np.exp(np.median(differences)))
    k = tail_rank(len(a), len(b), confidence)
    if k == 0:
        return ratio, 0.0, math.inf
    return ratio, float(np.exp(differences[k - 1])), float(np.exp(differences[-k]))
