"""Multi-rank benchmarks: every rank's iterations (gathered to all ranks by ``distributed.gather_objects``)
merged field by field by each metric's rule (``opsd_rollout.metrics``: latency the slowest rank's, throughput
and token counts summed, memory the largest rank's, ratios and losses averaged), and the skew between ranks
per stage."""

from __future__ import annotations

from typing import Any

from opsd_rollout.bench.stats import is_number, median
from opsd_rollout.metrics import metric

SKEW_THRESHOLD = 1.2
"""A stage whose slowest rank takes more than this times the median rank's time is flagged."""

_MERGE = {"max": max, "sum": sum, "mean": lambda values: sum(values) / len(values)}


def merge_iterations(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Iteration ``i`` of the run = iteration ``i`` of every rank, merged field by field (``rank`` becomes
    ``None``: the merged view is no single rank's)."""
    merged = []
    for rows in zip(*per_rank):
        out = dict(rows[0])
        for key, value in rows[0].items():
            values = [row.get(key) for row in rows]
            if key != "rank" and is_number(value) and all(is_number(v) for v in values):
                out[key] = _MERGE[metric(key).merge](values)
        out["rank"] = None
        merged.append(out)
    return merged


def stage_skew(per_rank: list[list[dict[str, Any]]], threshold: float = SKEW_THRESHOLD) -> dict[str, Any]:
    """For every time field (``*_ms``): max / median of the ranks' median times, and the slowest rank."""
    skew = {}
    for key, value in per_rank[0][0].items() if per_rank and per_rank[0] else []:
        if not key.endswith("_ms") or not is_number(value):
            continue
        medians = [median(row[key] for row in rows if is_number(row.get(key))) for rows in per_rank]
        middle = median(medians)
        ratio = max(medians) / middle if middle > 0 else 1.0
        skew[key] = {"max_over_median": ratio, "slowest_rank": medians.index(max(medians)),
                     "rank_medians_ms": medians, "flagged": ratio > threshold}
    return skew
