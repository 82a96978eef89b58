"""``Stats``: the one summary of a list of measurements, used by the bench, the report and ``compare``."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

def is_number(value: Any) -> bool:
    """An int or float measurement (not a bool, not None)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
    """The measurements themselves, kept for ``merge`` and significance tests; not serialized."""

    @classmethod
    def from_values(cls, values: Iterable[float | int | None]) -> "Stats | None":
        """Summary of the finite values; ``None`` when there are none (e.g. a metric that was not recorded)."""
        finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
        if not finite:
            return None
        array = np.asarray(finite, dtype=np.float64)
        q25, p50, q75, p95 = np.percentile(array, [25, 50, 75, 95])
        return cls(count=len(finite), mean=float(array.mean()), p50=float(p50), p95=float(p95),
                   min=float(array.min()), max=float(array.max()),
                   stdev=float(array.std(ddof=1)) if len(finite) > 1 else 0.0, iqr=float(q75 - q25),
                   values=tuple(finite))

    @classmethod
    def merge(cls, parts: Sequence["Stats | None"]) -> "Stats | None":
        """The summary of all the parts' measurements together (e.g. several ranks or runs)."""
        return cls.from_values(v for part in parts if part is not None for v in part.values)

    @property
    def spread(self) -> float:
        """IQR / median (0 when the median is 0)."""
        return self.iqr / abs(self.p50) if self.p50 else 0.0

    @property
    def noisy(self) -> bool:
        return self.spread > SPREAD_WARNING

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean, "p50": self.p50, "p95": self.p95, "min": self.min,
                "max": self.max, "stdev": self.stdev, "iqr": self.iqr}

    @classmethod
    def from_dict(cls, data: dict[str, Any], values: Sequence[float] = ()) -> "Stats":
        return cls(**{k: data[k] for k in ("count", "mean", "p50", "p95", "min", "max", "stdev", "iqr")},
                   values=tuple(values))
