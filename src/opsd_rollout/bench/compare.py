"""``opsd-rollout compare BEFORE.json AFTER.json``: per config and metric, the ratio of the medians (after /
before) with a bootstrap confidence interval from the raw iterations, and a verdict.

A change is *significant* when its whole interval lies on one side of 1 (the runs' own noise cannot explain
it), and a *regression* when its whole interval lies beyond the threshold on the worse side (and it moves
by at least 1 ms or 1 MiB). Two runs of the same code then rarely disagree: a shared machine's drift widens
the interval instead of flagging a regression. Comparing nothing is an error, not a pass.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
from rich.table import Table

from opsd_rollout.bench.report import ConfigResult, compact_table, display_labels, fmt, results_of
from opsd_rollout.bench.scenarios import scenario_class
from opsd_rollout.bench.stats import Stats
from opsd_rollout.metrics import METRICS

COMPARED = tuple(name for name, m in METRICS.items() if m.compared)
"""The metrics ``compare`` judges (those the registry marks ``compared``)."""
CONFIDENCE = 0.95
RESAMPLES = 2000
TEST_NAME = (f"{CONFIDENCE:.0%} bootstrap confidence interval of the ratio of medians (after / before), "
             f"{RESAMPLES} resamples of each side's iterations")
MIN_ABSOLUTE = {"ms": 1.0, "bytes": 2**20}
"""Smallest absolute change that can count as a regression, per unit: sub-millisecond stages and a few
hundred kB of RSS move on a shared machine without any code change."""

EXIT_REGRESSION, EXIT_NOTHING_COMPARED, EXIT_PARTIAL = 1, 3, 4
"""Exit statuses of ``opsd-rollout compare`` (0: compared, no regression; 2: bad input)."""


def bootstrap_ratio(before: list[float], after: list[float], *, resamples: int = RESAMPLES,
                    confidence: float = CONFIDENCE, seed: int = 0) -> tuple[float, float, float]:
    """``(median(after) / median(before), low, high)``: the ratio and its bootstrap confidence interval."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
    a_medians = np.median(a[rng.integers(0, len(a), (resamples, len(a)))], axis=1)
    b_medians = np.median(b[rng.integers(0, len(b), (resamples, len(b)))], axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = b_medians / a_medians
    ratios = ratios[np.isfinite(ratios)]
    ratio = float(np.median(b) / np.median(a)) if np.median(a) else float("nan")
    if not len(ratios):
        return ratio, float("nan"), float("nan")
    tail = (1 - confidence) / 2
    low, high = np.quantile(ratios, [tail, 1 - tail])
    return ratio, float(low), float(high)


@dataclass(frozen=True)
class MetricChange:
    key: str
    label: str
    metric: str
    before: float
    after: float
    ratio: float
    low: float
    high: float
    """The ratio's confidence interval."""
    significant: bool
    regression: bool

    @property
    def change_pct(self) -> float:
        return 100.0 * (self.ratio - 1.0)

    @property
    def verdict(self) -> str:
        if not self.significant:
            return "no significant change"
        better = (self.after < self.before) == METRICS[self.metric].lower_is_better
        return ("better" if better else "worse") + (" - REGRESSION" if self.regression else "")


def judge(key: str, label: str, metric: str, a: Stats, b: Stats, threshold_pct: float) -> MetricChange:
    ratio, low, high = bootstrap_ratio(list(a.values), list(b.values))
    significant = low > 1.0 or high < 1.0
    lower_is_better = METRICS[metric].lower_is_better
    beyond = low > 1 + threshold_pct / 100 if lower_is_better else high < 1 - threshold_pct / 100
    large = abs(b.p50 - a.p50) >= MIN_ABSOLUTE.get(METRICS[metric].unit, 0.0)
    return MetricChange(key, label, metric, a.p50, b.p50, ratio, low, high, significant,
                        significant and beyond and large)


@dataclass
class Comparison:
    """What ``compare_documents`` found."""

    changes: list[MetricChange] = field(default_factory=list)
    matched: int = 0
    """Configs present and measured in both files."""
    only_before: list[str] = field(default_factory=list)
    only_after: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def regressions(self) -> list[MetricChange]:
        return [c for c in self.changes if c.regression]

    def exit_status(self, allow_partial: bool = False) -> int:
        if not self.matched:
            return EXIT_NOTHING_COMPARED
        if self.regressions:
            return EXIT_REGRESSION
        if (self.only_before or self.only_after) and not allow_partial:
            return EXIT_PARTIAL
        return 0


def _match_key(result: ConfigResult, ignore: tuple[str, ...]) -> str:
    if not ignore:
        return result.config.key
    config = {k: v for k, v in asdict(result.config).items() if k not in ignore}
    return "|".join(f"{k}={v}" for k, v in sorted(config.items()) if v is not None)


def compare_documents(before: dict[str, Any], after: dict[str, Any], *, threshold_pct: float = 5.0,
                      ignore: tuple[str, ...] = ()) -> Comparison:
    """Every config present and ``ok`` in both files, judged metric by metric. ``ignore`` names config axes left
    out of the matching (e.g. ``strategy``, to compare two strategies)."""
    kinds = {before.get("kind", "rollout"), after.get("kind", "rollout")}
    if len(kinds) > 1:
        raise ValueError(f"cannot compare a {before.get('kind')} benchmark with a {after.get('kind')} one")
    config_type = scenario_class(kinds.pop()).config_type
    axes = [f.name for f in fields(config_type)]
    unknown = [axis for axis in ignore if axis not in axes]
    if unknown:
        raise ValueError(f"--ignore-axes: unknown axes {unknown}; axes are {axes}")
    out = Comparison()
    old, new = {}, {}
    for side, document, table in (("BEFORE", before, old), ("AFTER", after, new)):
        for result in results_of(document, config_type):
            key = _match_key(result, ignore)
            if key in table:
                out.notes.append(f"{side}: {result.config.key} and {table[key].config.key} match the same config "
                                 f"once {', '.join(ignore)} is ignored; only the first is compared")
                continue
            table[key] = result
    names = display_labels([r.config for r in new.values()])
    for key, result in new.items():
        if key not in old:
            out.only_after.append(result.config.key)
            continue
        if result.status != "ok" or old[key].status != "ok":
            out.notes.append(f"{result.config.key}: status {old[key].status} -> {result.status}, not compared")
            continue
        out.matched += 1
        for metric in COMPARED:
            a, b = old[key].metric(metric), result.metric(metric)
            if a is not None and b is not None:
                out.changes.append(judge(key, names[result.config.key], metric, a, b, threshold_pct))
    out.only_before = [result.config.key for key, result in old.items() if key not in new]
    return out


def _value(metric: str, value: float) -> str:
    return fmt(value / 2**20, 0) if METRICS[metric].unit == "bytes" else fmt(value, 2)


def _name(metric: str) -> str:
    """The metric's label with its unit where the label does not say it (``total ms``, ``peak MiB``)."""
    unit = {"ms": " ms", "bytes": " MiB"}.get(METRICS[metric].unit, "")
    return METRICS[metric].label + unit


def comparison_table(comparison: Comparison) -> Table:
    rows = [([c.label, _name(c.metric), _value(c.metric, c.before),
              _value(c.metric, c.after), f"{c.change_pct:+.1f}%", f"{c.low:.2f}-{c.high:.2f}", c.verdict],
             "bold red" if c.regression else ("green" if c.verdict == "better" else None))
            for c in comparison.changes]
    return compact_table("before -> after (medians)", ["config", "metric", "before", "after", "change", "95% CI",
                                                        "verdict"], rows)


def comparison_markdown(comparison: Comparison, threshold_pct: float) -> str:
    lines = [f"Test: {TEST_NAME}. A change is significant when its interval excludes 1; a regression when its "
             f"whole interval is worse than {threshold_pct:g}% (and it moves at least 1 ms for times, 1 MiB for "
             "memory).", "",
             "| config | metric | before (p50) | after (p50) | change | 95% CI of the ratio | verdict |",
             "|---|---|---:|---:|---:|---:|---|"]
    lines += [f"| {c.label} | {_name(c.metric)} | {_value(c.metric, c.before)} | "
              f"{_value(c.metric, c.after)} | {c.change_pct:+.1f}% | {c.low:.3f}-{c.high:.3f} | {c.verdict} |"
              for c in comparison.changes]
    notes = comparison_notes(comparison)
    if notes:
        lines += ["", *[f"- {note}" for note in notes]]
    return "\n".join(lines) + "\n"


def comparison_notes(comparison: Comparison) -> list[str]:
    notes = list(comparison.notes)
    notes += [f"{key}: only in BEFORE" for key in comparison.only_before]
    notes += [f"{key}: only in AFTER" for key in comparison.only_after]
    return notes
