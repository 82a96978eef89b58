"""What ``compare`` prints and writes: the terminal table (as wide as the terminal it has), the footnote that
names the test, the notes, and the Markdown table. ``bench/compare.py`` decides; this module only shows."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from opsd_rollout.bench.compare import (CONFIDENCE, FEWEST_PROCESSES, MIN_ABSOLUTE, TEST_NAME, UNKNOWN_PROCESS_SPREAD,
                                        Comparison, MetricChange)
from opsd_rollout.bench.tables import CompactTable, fmt, mib
from opsd_rollout.metrics import METRICS

DROPPED_FIRST = (("within %", "between %"), ("before", "after"), ("95% CI",))
"""The columns a narrow terminal loses, in this order: the spreads and the medians are in the Markdown report, and
the verdict (with the change) says what the interval decided."""


def _value(metric: str, value: float, digits: int | None = None) -> str:
    """Memory in MiB; other figures to ``digits`` decimals, or (``None``) to three or four significant ones,
    which is all a noisy median has and what keeps the terminal's columns narrow."""
    if METRICS[metric].unit == "bytes":
        return mib(value)
    if digits is None:
        digits = 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2
    return fmt(value, digits)


def _name(metric: str) -> str:
    """The metric's label with its unit where the label does not say it (``total ms``, ``peak MiB``)."""
    unit = {"ms": " ms", "bytes": " MiB"}.get(METRICS[metric].unit, "")
    return METRICS[metric].label + unit


def _interval(change: MetricChange, digits: int) -> str:
    """The interval; judged both ways (``--pace both``), the adjusted one beside it (``adj``)."""
    if not change.bounded:
        return "-"
    shown = f"{change.low:.{digits}f}-{change.high:.{digits}f}"
    if change.adjusted is not None:
        shown += f" (adj {change.adjusted[1]:.{digits}f}-{change.adjusted[2]:.{digits}f})"
    return shown


def _spreads(pair: tuple[float | None, float | None]) -> str:
    """BEFORE's and AFTER's spread in percent, ``2/3``; ``?`` for a side that cannot say (one process)."""
    return "/".join("?" if value is None else f"{100 * value:.0f}" for value in pair)


def _cells(change: MetricChange) -> dict[str, str]:
    return {"config": change.label, "metric": _name(change.metric), "before": _value(change.metric, change.before),
            "after": _value(change.metric, change.after), "change": f"{change.change_pct:+.1f}%",
            "95% CI": _interval(change, 2), "verdict": change.verdict, "disturbed": change.disturbed,
            "within %": _spreads(change.within), "between %": _spreads(change.between)}


def _style(change: MetricChange) -> str | None:
    if change.regression:
        return "bold red"
    if not change.judged:
        return "dim"
    return "green" if change.verdict == "better" else None


LABEL_WIDTH = 20
"""The config column is at least this wide (or as wide as its longest label): labels fold, not to a sliver."""


def _label_widths(comparison: Comparison) -> tuple[int, int]:
    """The config column's width unfolded, and the least it folds to."""
    natural = max([len("config"), *(len(c.label) for c in comparison.changes)])
    return natural, min(natural, LABEL_WIDTH)


def _table(comparison: Comparison, columns: list[str]) -> Table:
    """One row per config and metric; a config's label on its first row only."""
    rows, previous = [], None
    for change in comparison.changes:
        cells = _cells(change)
        if change.key == previous:
            cells["config"] = ""
        previous = change.key
        rows.append(([cells[column] for column in columns], _style(change)))
    table = CompactTable("before -> after (medians; change: Hodges-Lehmann ratio; spreads before/after)", columns, rows)
    table.columns[0].min_width = _label_widths(comparison)[1]
    return table


def _fits(table: Table, comparison: Comparison, width: int) -> bool:
    """Whether ``table`` fits ``width`` columns with its labels folded and no other cell cut. Rich measures a
    cell that must not wrap by its longest word, so the width is the table's unfolded one less what folding
    the labels saves."""
    unfolded = Console(width=10_000, file=io.StringIO()).measure(table).maximum
    natural, folded = _label_widths(comparison)
    return unfolded - (natural - folded) <= width


def comparison_table(comparison: Comparison, width: int = 160) -> Table:
    """The comparison, one row per config and metric, in ``width`` columns: the config label folds, and where
    that is not enough the columns of ``DROPPED_FIRST`` go, in that order. ``disturbed`` (which file a config
    was disturbed in) appears when any was."""
    columns = ["config", "metric", "before", "after", "change", "95% CI", "within %", "between %", "verdict"]
    if comparison.disturbed:
        columns.append("disturbed")
    for dropped in ((), *DROPPED_FIRST):
        columns = [column for column in columns if column not in dropped]
        table = _table(comparison, columns)
        if _fits(table, comparison, width):
            break
    return table


def footnote(threshold_pct: float) -> str:
    """The line under the table: the test, its units, and what makes a change significant and a regression."""
    return (f"test: {TEST_NAME}; the units are the processes' medians where both files measured the config in "
            f"{FEWEST_PROCESSES} or more processes (paced: adjusted for their reference workload's, the machine's "
            "pace; both ways: as measured and adjusted, adj the adjusted interval, a regression only where both are "
            "one), "
            "else the iterations, the interval then widened by "
            f"{UNKNOWN_PROCESS_SPREAD:.0%} each way (the spread between processes unknown). Significant: the interval "
            f"excludes 1; a regression: the whole interval is worse than {threshold_pct:g}% and the medians move at "
            f"least {MIN_ABSOLUTE['ms']:g} ms (times) or 1 MiB (memory); disturbed configs are not judged unless "
            "--allow-disturbed. Spreads (IQR/median, before/after): within a process, and between the processes' "
            "medians (? with one process).")


def comparison_markdown(comparison: Comparison, threshold_pct: float) -> str:
    disturbed = bool(comparison.disturbed)
    header = ["config", "metric", "before (p50)", "after (p50)", "change", f"{CONFIDENCE:.0%} CI of the ratio",
              "verdict", "units", "spread within %", "spread between %"] + (["disturbed"] if disturbed else [])
    lines = [footnote(threshold_pct), "", "| " + " | ".join(header) + " |",
             "|---|---|---:|---:|---:|---:|---|---|---:|---:|" + ("---|" if disturbed else "")]
    for c in comparison.changes:
        cells = _cells(c)
        how = ", paced" if c.paced else ", both ways" if c.adjusted is not None else ""
        basis = (f"processes{how} ({c.processes[0]}/{c.processes[1]})" if c.by_processes else
                 f"iterations, widened ({c.processes[0]}/{c.processes[1]} processes)")
        row = [cells["config"], cells["metric"], _value(c.metric, c.before, 2), _value(c.metric, c.after, 2),
               cells["change"], _interval(c, 3), cells["verdict"], basis, cells["within %"],
               cells["between %"]] + ([cells["disturbed"]] if disturbed else [])
        lines.append("| " + " | ".join(row) + " |")
    notes = comparison_notes(comparison)
    if notes:
        lines += ["", *[f"- {note}" for note in notes]]
    return "\n".join(lines) + "\n"


def comparison_notes(comparison: Comparison) -> list[str]:
    notes = list(comparison.notes)
    notes += [f"{key}: only in BEFORE" for key in comparison.only_before]
    notes += [f"{key}: only in AFTER" for key in comparison.only_after]
    return notes
