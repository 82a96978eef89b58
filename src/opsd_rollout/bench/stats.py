"""``Stats``: the one summary of a list of measurements, used by the bench, the report and ``compare``; and the
one median everything else uses."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np


def is_number(value: Any) -> bool:
    """An int or float measurement (not a bool, not None)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def median(values: Iterable[float]) -> float:
    """The median (the mean of the two middle values for an even count), as ``Stats.p50`` computes it."""
    return float(statistics.median(values))


def median_index(values: Sequence[float]) -> int:
    """The index of a median element of ``values`` (the lower of the two middles for an even count): for
    picking a representative measurement, not a figure."""
    order = sorted(range(len(values)), key=values.__getitem__)
    return order[(len(order) - 1) // 2]


SPREAD_WARNING = 0.10
"""IQR / median above this makes a summary say its numbers are noisy."""


@dataclass(frozen=True, kw_only=True)
class Stats:
    """count, mean, p50, p95, min, max, stdev (sample, ddof=1) and IQR of finite values."""

    count: int
    mean: float
    p50: float
    p95: float
    min: float
    max: float
    stdev: float
    iqr: float
    values: tuple[float, ...] = field(default=(), repr=False, compare=False)
    """The measurements themselves, kept for significance tests; not serialized."""

    @classmethod
    def from_values(cls, values: Iterable[float | int | None]) -> "Stats | None":
        """Summary of the finite values; ``None`` when there are none (e.g. a metric that was not recorded)."""
        finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
        if not finite:
            return None
        array = np.asarray(finite, dtype=np.float64)
        q25, q75, p95 = np.percentile(array, [25, 75, 95])
        return cls(count=len(finite), mean=float(array.mean()), p50=median(finite), p95=float(p95),
                   min=float(array.min()), max=float(array.max()),
                   stdev=float(array.std(ddof=1)) if len(finite) > 1 else 0.0, iqr=float(q75 - q25),
                   values=tuple(finite))

    @property
    def spread(self) -> float:
        """IQR / median (0 when the median is 0)."""
        return self.iqr / abs(self.p50) if self.p50 else 0.0

    @property
    def noisy(self) -> bool:
        return self.spread > SPREAD_WARNING

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "values"}
