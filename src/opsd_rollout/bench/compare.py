"""``opsd-rollout compare BEFORE.json AFTER.json``: per config and metric, how much AFTER differs from BEFORE
(the Hodges-Lehmann ratio with its 95% interval: ``bench/ratio_test.py``) and a verdict.

What the interval is over: two fresh processes of the same code differ by 5-20% (memory layout, thread placement,
clock state), far more than the iterations inside one, so an interval over the iterations of one process a side
measures the wrong noise and flags same-code reruns. Where both files measured a config in at least
``fewest_iterations`` processes (``--processes``, 4 at 95%), the units are the processes: each process's median
of the metric, the ratio and its interval over those. Where a side has fewer, the spread between processes is
unknown (one process) or too little known to bound an interval (2-3): the interval over the iterations is widened
by ``UNKNOWN_PROCESS_SPREAD`` each way, so a verdict never rests on more certainty than the files hold, and a note
says so.

The machine's pace: the runner times a fixed reference workload (plain torch ops, none of the code under test)
beside every iteration, and where both files have it in every process a note says how far it moved between them (a
machine slower for a stretch, with no steal or load to show for it). ``pace`` (``--pace``, ``PACE_JUDGEMENTS``) says
what is judged: ``measured``, the times as measured; ``adjusted``, the processes' medians by an analysis of
covariance on their median reference times (``bench/pace.py``); ``both``, the default, a metric is a regression only
when both of those judge it one. At 12 processes a side each of the first two gave a false alarm in a set of
same-code pairs where the other gave none, and ``both`` none in 40 pairs, fixed before the last 20, while flagging
every planted 15% slowdown (RESULTS, "Both ways"). A config whose files lack the reference is judged as measured.

What may be compared: both files must have measured the same work, or a faster AFTER only means less work. So
the kind, every setting that changes the work (the model, the teacher, the prompts, sampling, the seed: all but
the warm-up and iteration counts, ``PROCEDURE``) and the number of ranks must agree, or ``MismatchError`` (exit
2) names what differs (``bench/same_work.py``); ``ignore`` (``--ignore-axes``) lets named ones differ. Configs are
then matched on every axis: dtype, shapes, strategy and the workload's lengths are in their key.

A change is *significant* when its whole interval lies on one side of 1 (the runs' own noise cannot explain
it), and a *regression* when its whole interval lies beyond the threshold on the worse side (and it moves
by at least 1 ms or 1 MiB). A config that the runner flagged *disturbed* on either side (other processes or the
hypervisor took CPU while it ran: ``bench/stability.py``) is not evidence either way: its verdict is
``disturbed``, unless ``allow_disturbed`` (``--allow-disturbed``) judges it anyway.

Exit statuses, the first that applies: 2 bad input (a file unreadable, different work, an unknown axis); 3
nothing compared (no config measured in both files); 1 a regression among the judged configs; 5 disturbed (a
compared config was disturbed on either side and not judged, also when every one was: not a pass); 4 partial
(a file has configs the other lacks, unless ``allow_partial``); 0 compared, no regression.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from opsd_rollout.bench.contenders import CONFIDENCE
from opsd_rollout.bench.pace import REFERENCE_METRIC, adjusted_ratio, check_pace, machine_note, paced_medians
from opsd_rollout.bench.ratio_test import fewest_iterations, ratio_interval
from opsd_rollout.bench.report import ConfigResult, RecordedConfig, config_values, results_of
from opsd_rollout.bench.same_work import check_same_work, matrix_notes, work_of
from opsd_rollout.bench.scenarios import SCENARIOS
from opsd_rollout.bench.stats import median
from opsd_rollout.bench.tables import display_labels
from opsd_rollout.metrics import METRICS

COMPARED = tuple(name for name, m in METRICS.items() if m.compared)
"""The metrics ``compare`` judges (those the registry marks ``compared``)."""
TEST_NAME = (f"Hodges-Lehmann ratio (after / before: the median over every pair of a before and an after "
             f"unit) with its {CONFIDENCE:.0%} distribution-free confidence interval (Moses: Mann-Whitney ranks of "
             "the log ratios)")
FEWEST_PROCESSES = fewest_iterations(CONFIDENCE)
"""Processes a side (and a config) from which the processes are the units: the fewest that bound the interval."""
UNKNOWN_PROCESS_SPREAD = 0.20
"""How far apart two fresh processes of the same code may be, for an interval whose files do not say: each bound
of an interval over iterations moves this much further from the ratio (low / 1.2, high x 1.2). The smoke matrix's
same-code reruns differed by 5-20% between processes (issue 52; ``benchmarks/variance/``), its short stages the
most: with it, a planted 1.5x slowdown over a few percent of noise is still a regression and a same-code rerun
never is."""
MIN_ABSOLUTE = {"ms": 1.0, "bytes": 2**20}
"""Smallest absolute change that can count as a regression, per unit: sub-millisecond stages and a few
hundred kB of RSS move on a shared machine without any code change."""

EXIT_REGRESSION, EXIT_BAD_INPUT, EXIT_NOTHING_COMPARED, EXIT_PARTIAL, EXIT_DISTURBED = 1, 2, 3, 4, 5
"""Exit statuses of ``opsd-rollout compare`` (0: compared, no regression); see the module docstring."""

SIDES = {(True, False): "before", (False, True): "after", (True, True): "both"}
"""Which file a disturbed config was disturbed in."""


@dataclass(frozen=True)
class MetricChange:
    key: str
    label: str
    metric: str
    before: float
    """BEFORE's median."""
    after: float
    ratio: float
    """The Hodges-Lehmann estimate of after / before."""
    low: float
    high: float
    """The ratio's confidence interval (0 to infinity when the iterations are too few to bound it)."""
    significant: bool
    regression: bool
    disturbed: str = ""
    """``before``, ``after`` or ``both`` when the runner flagged the config disturbed there; empty otherwise."""
    judged: bool = True
    """False: disturbed and not judged (its verdict is ``disturbed``, never a regression)."""
    by_processes: bool = False
    """Whether the units were the processes' medians; ``False``: the iterations, the interval widened by
    ``UNKNOWN_PROCESS_SPREAD`` each way."""
    processes: tuple[int, int] = (1, 1)
    """Processes BEFORE and AFTER measured the config in."""
    within: tuple[float | None, float | None] = (None, None)
    """BEFORE's and AFTER's spread (IQR/median) of the iterations inside a process (the median over processes)."""
    between: tuple[float | None, float | None] = (None, None)
    """BEFORE's and AFTER's spread (IQR/median) of the processes' medians; ``None``: one process, unknown."""
    paced: bool = False
    """Whether the units were the processes' medians adjusted for their reference workload's (``bench/pace.py``):
    the ratio is then the code's change with the machine's taken out, and may differ from ``after / before``."""
    adjusted: tuple[float, float, float] | None = None
    """Judged both ways (``pace="both"``): the ratio and interval adjusted for the machine's pace, beside the ratio
    and interval as measured above; ``significant`` and ``regression`` hold only where they hold both ways."""

    @property
    def change_pct(self) -> float:
        return 100.0 * (self.ratio - 1.0)

    @property
    def bounded(self) -> bool:
        return self.high != float("inf")

    @property
    def verdict(self) -> str:
        if not self.judged:
            return "disturbed"
        if not self.bounded:
            return "too few iterations"
        if not self.significant:
            return "not significant"
        if self.regression:
            return "REGRESSION"
        return "better" if (self.ratio < 1) == METRICS[self.metric].lower_is_better else "worse"


def flaggable_pct(change: MetricChange, threshold_pct: float) -> float | None:
    """The smallest change for the worse, in percent, that an interval as wide as ``change``'s around its ratio
    would have flagged at ``threshold_pct`` (a slowdown for a time, a drop for a throughput); judged both ways, the
    larger of the two intervals' (a flag needs both); ``None`` when an interval is unbounded or the metric has no
    worse side."""
    lower_is_better = METRICS[change.metric].lower_is_better
    intervals = [(change.ratio, change.low, change.high), *([change.adjusted] if change.adjusted else [])]
    if lower_is_better is None or any(high == float("inf") or low <= 0 for _, low, high in intervals):
        return None
    if lower_is_better:
        return max(100 * ((1 + threshold_pct / 100) * ratio / low - 1) for ratio, low, _ in intervals)
    return max(100 * (1 - (1 - threshold_pct / 100) * ratio / high) for ratio, _, high in intervals)


def units(old: ConfigResult, new: ConfigResult, metric: str) -> tuple[list[float], list[float], bool]:
    """What ``metric`` is judged over: BEFORE's and AFTER's processes' medians when both have at least
    ``FEWEST_PROCESSES`` (and ``True``), else their iterations (and ``False``)."""
    a, b = old.process_medians(metric), new.process_medians(metric)
    if min(len(a), len(b)) >= FEWEST_PROCESSES:
        return a, b, True
    a, b = old.metric(metric), new.metric(metric)
    return list(a.values) if a else [], list(b.values) if b else [], False


def _interval(a: list[float], b: list[float], by_processes: bool) -> tuple[float, float, float]:
    """The ratio AFTER / BEFORE of units ``a`` and ``b`` and its interval, widened where they are iterations."""
    ratio, low, high = ratio_interval(a, b, CONFIDENCE)
    if not by_processes and high != float("inf"):  # the spread between processes is not in these iterations
        low, high = low / (1 + UNKNOWN_PROCESS_SPREAD), high * (1 + UNKNOWN_PROCESS_SPREAD)
    return ratio, low, high


def _flags(metric: str, low: float, high: float, threshold_pct: float) -> tuple[bool, bool]:
    """Whether an interval is significant (excludes 1), and whether it lies wholly beyond ``threshold_pct`` on
    ``metric``'s worse side."""
    beyond = low > 1 + threshold_pct / 100 if METRICS[metric].lower_is_better else high < 1 - threshold_pct / 100
    return low > 1.0 or high < 1.0, beyond


def judge(key: str, label: str, metric: str, old: ConfigResult, new: ConfigResult, threshold_pct: float, *,
          disturbed: str = "", judged: bool = True, pace: str = "both") -> MetricChange | None:
    """One metric of one config, over the units ``units`` gives (positive values); ``None`` when a side lacks it.
    ``pace`` (one of ``PACE_JUDGEMENTS``): ``adjusted`` judges, where the config was judged by processes and timed
    beside the reference in both files, the ratio and interval of the analysis of covariance on the reference
    (``bench/pace.py``); ``both`` judges those and the times as measured, a regression only where both find one
    (``compare_documents`` has checked ``pace``)."""
    a, b, by_processes = units(old, new, metric)
    if not a or not b:
        return None
    pa, pb = (paced_medians(old, metric), paced_medians(new, metric)) if pace != "measured" and by_processes else (
        None, None)
    adjusted = adjusted_ratio(pa, pb, CONFIDENCE)[:3] if pa is not None and pb is not None else None
    ratio, low, high = adjusted if adjusted is not None and pace == "adjusted" else _interval(a, b, by_processes)
    significant, beyond = _flags(metric, low, high, threshold_pct)
    if adjusted is not None and pace == "both":
        significant_adjusted, beyond_adjusted = _flags(metric, adjusted[1], adjusted[2], threshold_pct)
        significant, beyond = significant and significant_adjusted, beyond and beyond_adjusted
    significant = judged and significant
    before, after = median(a), median(b)
    large = abs(after - before) >= MIN_ABSOLUTE.get(METRICS[metric].unit, 0.0)
    return MetricChange(key, label, metric, before, after, ratio, low, high, significant,
                        significant and beyond and large, disturbed, judged, by_processes,
                        (old.process_count, new.process_count),
                        (old.within_spread(metric), new.within_spread(metric)),
                        (old.between_spread(metric), new.between_spread(metric)),
                        adjusted is not None and pace == "adjusted",
                        adjusted if pace == "both" else None)


@dataclass
class Comparison:
    """What ``compare_documents`` found."""

    changes: list[MetricChange] = field(default_factory=list)
    matched: int = 0
    """Configs present and measured in both files."""
    only_before: list[str] = field(default_factory=list)
    only_after: list[str] = field(default_factory=list)
    disturbed: dict[str, str] = field(default_factory=dict)
    """Compared configs disturbed on either side: key -> ``before``, ``after`` or ``both``."""
    judged_disturbed: bool = False
    """Whether the disturbed configs were judged all the same (``--allow-disturbed``)."""
    notes: list[str] = field(default_factory=list)
    machine: dict[str, float] = field(default_factory=dict)
    """Per config whose files timed the reference in every process: its reference workload's time AFTER / BEFORE
    (the processes' medians' medians): how far the machine moved between the runs."""

    @property
    def regressions(self) -> list[MetricChange]:
        return [c for c in self.changes if c.regression]

    @property
    def unjudged(self) -> list[str]:
        """Compared configs left without a verdict because they were disturbed."""
        return [] if self.judged_disturbed else list(self.disturbed)

    def exit_status(self, allow_partial: bool = False) -> int:
        if not self.matched:
            return EXIT_NOTHING_COMPARED
        if self.regressions:
            return EXIT_REGRESSION
        if self.unjudged:
            return EXIT_DISTURBED
        if (self.only_before or self.only_after) and not allow_partial:
            return EXIT_PARTIAL
        return 0


def _match_key(result: ConfigResult, ignore: tuple[str, ...]) -> str:
    if not ignore:
        return result.config.key
    config = {k: v for k, v in config_values(result.config).items() if k not in ignore}
    return "|".join(f"{k}={v}" for k, v in sorted(config.items()) if v is not None)


def _disturbed_note(label: str, old: ConfigResult, new: ConfigResult, judged: bool) -> str:
    reasons = [f"{side}: {'; '.join(r.interference.get('reasons') or ['flagged'])}"
               for side, r in (("BEFORE", old), ("AFTER", new)) if r.disturbed]
    verdict = "judged anyway (--allow-disturbed)" if judged else "not judged (--allow-disturbed judges it)"
    return f"{label}: disturbed ({'; '.join(reasons)}); {verdict}"


def _workload_note(label: str, old: ConfigResult, new: ConfigResult) -> str | None:
    """Configs whose runs generated different token counts did different work, whatever their keys say."""
    a, b = old.p50("generated_tokens"), new.p50("generated_tokens")
    if a is None or b is None or a == b:
        return None
    return f"{label}: generated tokens {a:g} in BEFORE, {b:g} in AFTER: the work itself changed"


def _iterations_note(label: str, old: ConfigResult, new: ConfigResult) -> str:
    return (f"{label}: {len(old.iterations)} and {len(new.iterations)} iterations cannot bound a ratio at "
            f"{CONFIDENCE:.0%}: measure at least {fewest_iterations(CONFIDENCE)} per side (--iterations)")


def _compare_config(out: Comparison, key: str, label: str, old: ConfigResult, new: ConfigResult,
                    threshold_pct: float, allow_disturbed: bool, pace: str) -> None:
    """Judge one matched config's metrics into ``out``, with its notes."""
    out.matched += 1
    side = SIDES.get((old.disturbed, new.disturbed), "")
    if side:
        out.disturbed[new.config.key] = side
        out.notes.append(_disturbed_note(label, old, new, allow_disturbed))
    note = _workload_note(label, old, new)
    if note:
        out.notes.append(note)
    changes = []
    for metric in COMPARED:
        a, b = old.metric(metric), new.metric(metric)
        if a is None or b is None:
            continue
        if min(a.values) <= 0 or min(b.values) <= 0:
            out.notes.append(f"{label}: {metric} has a value <= 0, not judged (a ratio needs positive values)")
            continue
        change = judge(key, label, metric, old, new, threshold_pct, disturbed=side, judged=allow_disturbed or not side,
                       pace=pace)
        if change is not None:
            changes.append(change)
    reference = [side.process_medians(REFERENCE_METRIC) for side in (old, new)]
    if all(len(medians) == side.process_count >= FEWEST_PROCESSES for medians, side in zip(reference, (old, new))):
        out.machine[new.config.key] = median(reference[1]) / median(reference[0])
    if any(not change.bounded for change in changes):
        out.notes.append(_iterations_note(label, old, new))
    out.changes += changes


def compare_documents(before: dict[str, Any], after: dict[str, Any], *, threshold_pct: float = 5.0,
                      ignore: tuple[str, ...] = (), allow_disturbed: bool = False,
                      pace: str = "both") -> Comparison:
    """Every config present and ``ok`` in both files, judged metric by metric. ``ignore`` names config axes left
    out of the matching (e.g. ``strategy``, to compare two strategies) and settings allowed to differ (e.g.
    ``model``); ``allow_disturbed`` judges configs that were disturbed too; ``pace`` says what a time is judged by
    (one of ``PACE_JUDGEMENTS``: as measured, adjusted for the reference workload both files timed, or both). A kind
    with no scenario in this package (the developers' kernels) is read from the documents alone: the keys, configs
    and settings they hold."""
    check_pace(pace)
    kinds = {before.get("kind", "rollout"), after.get("kind", "rollout")}
    if len(kinds) > 1:
        raise ValueError(f"cannot compare a {before.get('kind')} benchmark with a {after.get('kind')} one")
    scenario = SCENARIOS.get(kinds.pop())
    config_type = scenario.config_type if scenario else RecordedConfig
    settings_type = scenario.settings_type if scenario else None
    if scenario:
        axes = [f.name for f in fields(config_type)]
        matrix_axes = [(axis.name, axis.field) for axis in scenario.axes]
    else:
        axes = list(dict.fromkeys(name for document in (before, after) for result in document.get("results", [])
                                  for name in result["config"]))
        matrix_axes = [(name, name) for name in dict.fromkeys([*before.get("matrix", {}), *after.get("matrix", {})])]
    work = list(work_of(before, settings_type))
    unknown = [name for name in ignore if name not in axes and name not in work]
    if unknown:
        raise ValueError(f"--ignore-axes: unknown axes {unknown}; axes are {axes}; settings are {work}")
    out = Comparison(judged_disturbed=allow_disturbed)
    out.notes += check_same_work(before, after, settings_type, ignore)
    ignored_axes = tuple(name for name in ignore if name in axes)
    old, new = {}, {}
    for side, document, table in (("BEFORE", before, old), ("AFTER", after, new)):
        for result in results_of(document, config_type):
            key = _match_key(result, ignored_axes)
            if key in table:
                out.notes.append(f"{side}: {result.config.key} and {table[key].config.key} match the same config "
                                 f"once {', '.join(ignored_axes)} is ignored; only the first is compared")
                continue
            table[key] = result
    names = display_labels([r.config for r in new.values()])
    for key, result in new.items():
        if key not in old:
            out.only_after.append(result.config.key)
        elif result.status != "ok" or old[key].status != "ok":
            out.notes.append(f"{result.config.key}: status {old[key].status} -> {result.status}, not compared")
        else:
            _compare_config(out, key, names[result.config.key], old[key], result, threshold_pct, allow_disturbed,
                            pace)
    out.only_before = [result.config.key for key, result in old.items() if key not in new]
    if out.only_before or out.only_after:
        out.notes += matrix_notes(before, after, matrix_axes, ignored_axes)
    applied = ("both" if any(c.adjusted for c in out.changes) else "adjusted" if any(c.paced for c in out.changes)
               else "measured")
    for note in (machine_note(list(out.machine.values()), applied), widened_note(out.changes)):
        if note:
            out.notes.insert(0, note)
    return out


def widened_note(changes: list[MetricChange]) -> str | None:
    """Why some configs were judged over iterations with a widened interval: how many processes each side has."""
    widened = {change.key: change.processes for change in changes if not change.by_processes}
    if not widened:
        return None
    counts = sorted(set(widened.values()))
    sides = "; ".join(f"BEFORE {b} process{'es' * (b != 1)} and AFTER {a} process{'es' * (a != 1)} a config"
                      for b, a in counts)
    unknown = ("unknown" if any(1 in pair for pair in counts) else
               f"too little known to bound an interval over processes at {CONFIDENCE:.0%}")
    some = "every config" if len(widened) == len({c.key for c in changes}) else f"{len(widened)} config(s)"
    return (f"{some}: {sides}: the spread between processes is {unknown}, so the interval over the iterations is "
            f"widened by {UNKNOWN_PROCESS_SPREAD:.0%} each way (fresh processes of the same code differ by up to "
            f"that); measure both files with --processes {FEWEST_PROCESSES} or more to judge by processes")
