"""``opsd-rollout compare BEFORE.json AFTER.json``: per config and metric, the change of the median and
whether it is significant, judged on the raw iterations with a two-sided Mann-Whitney U test."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from rich.table import Table

from opsd_rollout.bench.report import ConfigResult, display_labels, results_of
from opsd_rollout.bench.scenarios import scenario_class
from opsd_rollout.bench.stats import Stats
from opsd_rollout.metrics import METRICS

COMPARED = tuple(name for name, m in METRICS.items() if m.compared)
"""The metrics ``compare`` judges (those the registry marks ``compared``)."""
TEST_NAME = "two-sided Mann-Whitney U (normal approximation, tie-corrected) on per-iteration values"


def mann_whitney_p(a: list[float], b: list[float]) -> float:
    """Two-sided p-value that ``a`` and ``b`` come from the same distribution."""
    n, m = len(a), len(b)
    if n == 0 or m == 0:
        return 1.0
    pooled = sorted([(v, 0) for v in a] + [(v, 1) for v in b])
    ranks = [0.0] * len(pooled)
    tie_term, i = 0.0, 0
    while i < len(pooled):
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1
        tie_term += (j - i + 1)**3 - (j - i + 1)
        i = j + 1
    rank_sum_a = sum(r for r, (_, group) in zip(ranks, pooled) if group == 0)
    u = rank_sum_a - n * (n + 1) / 2
    mean = n * m / 2
    variance = n * m / 12 * ((n + m + 1) - tie_term / ((n + m) * (n + m - 1)))
    if variance <= 0:
        return 1.0
    z = (abs(u - mean) - 0.5) / math.sqrt(variance)  # continuity correction
    return max(0.0, min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2))))


@dataclass(frozen=True)
class MetricChange:
    key: str
    label: str
    metric: str
    before: float
    after: float
    p_value: float
    significant: bool
    regression: bool

    @property
    def change_pct(self) -> float:
        return 100.0 * (self.after - self.before) / self.before if self.before else 0.0

    @property
    def verdict(self) -> str:
        if not self.significant:
            return "no significant change"
        better = (self.after < self.before) == METRICS[self.metric].lower_is_better
        return ("better" if better else "worse") + (" - REGRESSION" if self.regression else "")


# smallest absolute change that can count as a regression, per unit: sub-millisecond stages and a few
# hundred kB of RSS move on a shared machine without any code change
MIN_ABSOLUTE = {"ms": 1.0, "bytes": 2**20}


def _match_key(result: ConfigResult, ignore: tuple[str, ...]) -> str:
    if not ignore:
        return result.config.key
    config = {k: v for k, v in asdict(result.config).items() if k not in ignore}
    return "|".join(f"{k}={v}" for k, v in sorted(config.items()) if v is not None)


def compare_documents(before: dict[str, Any], after: dict[str, Any], *, threshold_pct: float = 5.0,
                      alpha: float = 0.05, ignore: tuple[str, ...] = ()) -> tuple[list[MetricChange], list[str]]:
    """Changes for every config present in both files and ``ok`` in both; plus notes on unmatched ones.
    ``ignore`` names config axes left out of the matching (e.g. ``strategy``, to compare two strategies)."""
    kinds = {before.get("kind", "rollout"), after.get("kind", "rollout")}
    if len(kinds) > 1:
        raise ValueError(f"cannot compare a {before.get('kind')} benchmark with a {after.get('kind')} one")
    config_type = scenario_class(kinds.pop()).config_type
    axes = [f.name for f in fields(config_type)]
    unknown = [axis for axis in ignore if axis not in axes]
    if unknown:
        raise ValueError(f"--ignore-axes: unknown axes {unknown}; axes are {axes}")
    changes, notes = [], []
    old, new = {}, {}
    for side, document, table in (("BEFORE", before, old), ("AFTER", after, new)):
        for result in results_of(document, config_type):
            key = _match_key(result, ignore)
            if key in table:
                notes.append(f"{side}: {result.config.key} and {table[key].config.key} match the same config once "
                             f"{', '.join(ignore)} is ignored; only the first is compared")
                continue
            table[key] = result
    names = display_labels([r.config for r in new.values()])
    labels = {key: names[result.config.key] for key, result in new.items()}
    for key, result in new.items():
        if key not in old:
            notes.append(f"{key}: only in AFTER")
            continue
        if result.status != "ok" or old[key].status != "ok":
            notes.append(f"{key}: status {old[key].status} -> {result.status}")
            continue
        floor = mann_whitney_p(list(range(len(old[key].iterations))),
                               list(range(len(old[key].iterations), len(old[key].iterations) + len(result.iterations))))
        if floor >= alpha:
            notes.append(f"{key}: with {len(old[key].iterations)} and {len(result.iterations)} iterations the "
                         f"smallest possible p is {floor:.3f} >= {alpha}: nothing can be significant; "
                         "rerun with more --iterations")
        for metric in COMPARED:
            a, b = old[key].metric(metric), result.metric(metric)
            if a is None or b is None:
                continue
            changes.append(_change(key, labels[key], metric, a, b, METRICS[metric].lower_is_better, threshold_pct,
                                   alpha))
    notes += [f"{key}: only in BEFORE" for key in old if key not in new]
    return changes, notes


def _change(key: str, label: str, metric: str, a: Stats, b: Stats, lower_is_better: bool, threshold_pct: float,
            alpha: float) -> MetricChange:
    p = mann_whitney_p(list(a.values), list(b.values))
    significant = p < alpha and a.p50 != b.p50
    worse = (b.p50 > a.p50) if lower_is_better else (b.p50 < a.p50)
    pct = abs(100.0 * (b.p50 - a.p50) / a.p50) if a.p50 else 0.0
    large = abs(b.p50 - a.p50) >= MIN_ABSOLUTE.get(METRICS[metric].unit, 0.0)
    return MetricChange(key, label, metric, a.p50, b.p50, p, significant,
                        significant and worse and pct > threshold_pct and large)


def comparison_table(changes: list[MetricChange]) -> Table:
    table = Table(title=f"before -> after (medians); significance: {TEST_NAME}, alpha 0.05", title_justify="left")
    for column in ("config", "metric", "before", "after", "change", "p", "verdict"):
        table.add_column(column, justify="right" if column in ("before", "after", "change", "p") else "left")
    for c in changes:
        style = "bold red" if c.regression else ("green" if c.verdict == "better" else None)
        table.add_row(c.label, c.metric, f"{c.before:,.2f}", f"{c.after:,.2f}", f"{c.change_pct:+.1f}%",
                      f"{c.p_value:.3f}", c.verdict, style=style)
    return table


def comparison_markdown(changes: list[MetricChange], notes: list[str], threshold_pct: float) -> str:
    lines = [f"Significance: {TEST_NAME}, alpha 0.05; a regression is a significant change for the worse of "
             f"more than {threshold_pct:g}% (and at least 1 ms for times, 1 MiB for memory).", "",
             "| config | metric | before (p50) | after (p50) | change | p | verdict |",
             "|---|---|---:|---:|---:|---:|---|"]
    lines += [f"| {c.label} | {c.metric} | {c.before:,.2f} | {c.after:,.2f} | {c.change_pct:+.1f}% | "
              f"{c.p_value:.3f} | {c.verdict} |" for c in changes]
    if notes:
        lines += ["", *[f"- {note}" for note in notes]]
    return "\n".join(lines) + "\n"
