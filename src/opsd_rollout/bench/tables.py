"""The pieces every table for people shares: display labels, number formats, phrase-aware titles, tables that
fold their value columns to the width they are given, and the config, stability and baseline tables. They read
the same ``ConfigResult`` objects as the JSON (``bench/report.py``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from opsd_rollout.bench.axes import VARIANT_AXES
from opsd_rollout.bench.contenders import CONFIDENCE
from opsd_rollout.bench.report import ConfigResult


def display_labels(configs: Sequence[Any]) -> dict[str, str]:
    """Short labels per config key: ``config.label`` plus whichever other axes vary across ``configs``
    (``Axis.describe``; a knob among the configs it applies to, left out of the others' labels)."""
    names = {f.name for config in configs for f in fields(config)}
    varying = [axis for axis in VARIANT_AXES if axis.field in names
               and len({getattr(c, axis.field) for c in configs if _applies(c, axis)}) > 1]

    def variant(config: Any) -> str:
        parts = [axis.describe(getattr(config, axis.field)) for axis in varying if _applies(config, axis)]
        return (" " + "/".join(parts)) if parts else ""

    return {c.key: c.label + variant(c) for c in configs}


def _applies(config: Any, axis: Any) -> bool:
    return getattr(config, "strategy", None) in axis.applies_to


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def mib(value: float | None) -> str:
    """Bytes in a table's memory column (its header says MiB), whole."""
    return fmt(value / 2**20 if value is not None else None, 0)


LABEL_WIDTH = 16
"""Cells a table's label column keeps at the least (its labels fold onto more lines below that): the value
columns fold into another table before the labels get narrower."""


def phrase_starts(text: str) -> list[int]:
    """Offsets where the phrases of ``text`` begin: after ``, `` ``; `` or ``: `` outside brackets (so
    "(at most 10 calls, 60 s)" is one phrase)."""
    starts, depth = [0], 0
    for index, char in enumerate(text):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth = max(0, depth - 1)
        elif char in ",;:" and depth == 0 and text[index + 1:index + 2] == " ":
            starts.append(index + 2)
    return starts


def phrase_breaks(text: str, width: int) -> list[int]:
    """Where lines start when ``text`` is packed into ``width`` cells a whole phrase at a time."""
    starts = phrase_starts(text)
    breaks, line_start = [], 0
    for start, end in zip(starts, [*starts[1:], len(text)]):
        if start > line_start and cell_len(text[line_start:end].rstrip()) > width:
            breaks.append(start)
            line_start = start
    return breaks


class PhraseText:
    """Text that wraps between phrases rather than between any two words, so a title reads "5 iterations after
    warm-up until steady" on one line, not "...after" / "warm-up..."; a phrase wider than the line wraps
    between its words. A renderable of its own (not a ``Text``: ``Console.print`` joins ``Text`` arguments
    into one plain ``Text``, which would wrap word by word)."""

    def __init__(self, text: str, style: str = ""):
        self.text, self.style = text, style

    def lines(self, width: int) -> list[str]:
        """The text's lines at ``width`` cells, broken between phrases."""
        out = []
        for line in self.text.split("\n"):
            starts = [0, *phrase_breaks(line, width), len(line)]
            out += [line[start:end].rstrip() for start, end in zip(starts, starts[1:])]
        return out

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield Text("\n".join(self.lines(options.max_width)), style=self.style)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, Text(self.text))


def _cell_width(text: str) -> int:
    """Cells the widest line of a table cell (markup and all) takes."""
    return max((cell_len(line) for line in Text.from_markup(text).plain.split("\n")), default=0)


def _table_width(label: int, values: Sequence[int]) -> int:
    """Cells a compact table takes: its edges, the label, and each value column with its separator and padding."""
    return 2 + label + sum(value + 2 for value in values)


def fold_columns(label: int, values: Sequence[int], max_width: int) -> list[range]:
    """The value columns in as few consecutive, even groups as fit ``max_width`` beside a label ``label`` wide
    (one column per group when even that does not fit)."""
    count = len(values)
    for parts in range(1, count + 1):
        size = -(-count // parts)
        groups = [range(start, min(start + size, count)) for start in range(0, count, size)]
        if all(_table_width(label, [values[i] for i in group]) <= max_width for group in groups):
            return groups
    return [range(i, i + 1) for i in range(count)]


class CompactTable(Table):
    """A table that fits the width it is rendered at: the label column (first) folds its labels, the value
    columns (numbers, verdicts) never wrap nor get cut; when they do not all fit beside the label, they fold
    into several tables one under the other, each with the labels again. The title wraps between phrases at
    the full width (not the table's). ``rows``: (cells, style)."""

    def __init__(self, title: str, columns: Sequence[str], rows: Sequence[tuple[Sequence[str], str | None]],
                 caption: str | None = None):
        super().__init__(title=title, title_justify="left", caption=caption, caption_justify="left",
                         box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True, pad_edge=False)
        self.headers = [columns[0], *(_two_lines(column) for column in columns[1:])]
        self.cells = [(list(cells), style) for cells, style in rows]
        self._add(self, range(len(self.headers) - 1))

    def _add(self, table: Table, group: range) -> Table:
        """Fill ``table`` with the label column and the value columns ``group``."""
        table.add_column(self.headers[0], justify="left", overflow="fold", ratio=1)
        for index in group:
            table.add_column(self.headers[index + 1], justify="right", no_wrap=True)
        for cells, style in self.cells:
            table.add_row(*([cells[0]] + [cells[i + 1] if i + 1 < len(cells) else "" for i in group]), style=style)
        return table

    def groups(self, max_width: int) -> list[range]:
        """The value columns of each table this one renders as at ``max_width``."""
        values = [max([_cell_width(self.headers[i])] + [_cell_width(cells[i]) for cells, _ in self.cells
                                                          if i < len(cells)]) for i in range(1, len(self.headers))]
        longest = max([_cell_width(cells[0]) for cells, _ in self.cells] + [_cell_width(self.headers[0])])
        return fold_columns(min(longest, LABEL_WIDTH), values, max_width) if values else [range(0)]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if self.title:
            yield PhraseText(str(self.title), style="table.title")
        for group in self.groups(options.max_width):
            yield self._add(Table(box=self.box, padding=(0, 1), collapse_padding=True, pad_edge=False), group)
        if self.caption:
            yield PhraseText(str(self.caption), style="table.caption")


def _two_lines(header: str) -> str:
    """A header of several words on two lines, split where the halves are most even: narrower columns."""
    words = header.split(" ")
    if len(words) < 2:
        return header
    split = min(range(1, len(words)), key=lambda i: abs(len(" ".join(words[:i])) - len(" ".join(words[i:]))))
    return " ".join(words[:split]) + "\n" + " ".join(words[split:])


def config_table(results: list[ConfigResult], title: str, columns: Sequence[str],
                 row: Callable[[ConfigResult], Sequence[str]], caption: str | None = None) -> Table:
    """One row per config: its display label, then ``row(result)`` for a measured config; one that was not
    has its status beside its label (its error is printed below the tables), leaving the value columns as
    narrow as their numbers."""
    labels = display_labels([r.config for r in results])
    rows = [([labels[r.config.key], *row(r)], None) if r.status == "ok"
            else ([f"{labels[r.config.key]}: {r.status} (see below)"], "red") for r in results]
    return CompactTable(title, ["config", *columns], rows, caption)


def stability_table(results: list[ConfigResult]) -> Table:
    """Per config: how it was warmed up, its first call, how much its measured iterations spread and whether
    anything disturbed them."""

    def row(result: ConfigResult) -> list[str]:
        warmup, total = result.warmup or {}, result.metric("total_ms")
        steady = {True: "", False: " (not steady)", None: ""}[warmup.get("steady")]
        return [f"{warmup.get('iterations', '-')}{steady}", fmt(warmup.get("first_call_ms")),
                f"{100 * total.spread:.0f}{result.spread_flag}", "yes" if result.disturbed else "no"]

    flagged = any(r.spread_flag for r in results if r.status == "ok")
    return config_table(results, "warm-up and noise", ["warm-up calls", "1st call ms", "spread %", "disturbed"], row,
                        caption="* spread (IQR/median) over 10%: see its warning below" if flagged else None)


def _ratio_cells(baseline: dict[str, Any], metric: str) -> list[str]:
    """A metric's ratio and its interval, for a table: ``0.52``, ``0.48-0.57`` (``too few`` when unbounded)."""
    figures = (baseline.get("metrics") or {}).get(metric)
    if figures is None:
        return ["-", "-"]
    high = figures.get("high")
    bounded = high is not None and math.isfinite(high)
    return [f"{figures['ratio']:.2f}", f"{figures['low']:.2f}-{high:.2f}" if bounded else "too few"]


def baseline_table(results: list[ConfigResult]) -> Table | None:
    """Per config with a baseline (several contenders): its time and throughput against its baseline's, each the
    Hodges-Lehmann ratio with its interval; ``None`` when no config has one."""
    compared = [r for r in results if r.status == "ok" and r.baseline]
    if not compared:
        return None
    baseline = compared[0].baseline
    confidence = baseline.get("confidence", CONFIDENCE)

    def row(result: ConfigResult) -> list[str]:
        if not result.baseline:
            return ["-"] * 4
        return _ratio_cells(result.baseline, "total_ms") + _ratio_cells(result.baseline, "tokens_per_second")

    from opsd_rollout.bench.ratio_test import fewest_iterations  # numpy: only when there are ratios to show

    title = (f"against {baseline['strategy']} (Hodges-Lehmann ratio over every pair of iterations, {confidence:.0%} "
             "interval)")
    caption = ("time ratio < 1 or tok/s ratio > 1: faster than the baseline; an interval that excludes 1 is beyond "
               "the runs' noise")
    if any("too few" in _ratio_cells(r.baseline, "total_ms") for r in compared):
        caption += f"; too few: bounding it takes {fewest_iterations(confidence)} iterations a config (--iterations)"
    return config_table(results, title, ["time ratio", "time CI", "tok/s ratio", "tok/s CI"], row, caption=caption)


def roofline_table(results: list[ConfigResult], sides: Sequence[tuple[str, str]]) -> Table | None:
    """Per config: the bytes a decode step must read (``decode_bytes_per_step``: weights + KV), and for each side
    ``(label, prefix)`` its achieved traffic (``<prefix>bandwidth_bytes_per_s``) and its share of the copy bandwidth
    the run measured at start (``<prefix>bandwidth_utilisation``); ``None`` when no config has the figures."""
    measured = [r for r in results if r.status == "ok" and r.derived.get("decode_bytes_per_step")]
    if not measured:
        return None

    def figure(value: float | None, scale: float) -> str:  # three significant digits: a tiny model's MB and GB/s too
        return "-" if not value else f"{value / scale:,.0f}" if value >= 100 * scale else f"{value / scale:.3g}"

    def cells(result: ConfigResult, prefix: str) -> list[str]:
        share = result.derived.get(f"{prefix}bandwidth_utilisation")
        return [figure(result.derived.get(f"{prefix}bandwidth_bytes_per_s"), 1e9), figure(share and 100 * share, 1)]

    def row(result: ConfigResult) -> list[str]:
        return [figure(result.derived.get("decode_bytes_per_step"), 1e6),
                *(c for _, prefix in sides for c in cells(result, prefix))]

    ceilings = [r.derived[f"{p}bandwidth_bytes_per_s"] / r.derived[f"{p}bandwidth_utilisation"]
                for r in measured for _, p in sides if r.derived.get(f"{p}bandwidth_utilisation")]
    copy = f"{ceilings[0] / 1e9:.1f} GB/s" if ceilings else "not measured"
    named = [f"{label} " if label else "" for label, _ in sides]
    columns = ["MB/step", *(c for name in named for c in (f"{name}GB/s", f"{name}roofline %"))]
    return config_table(results, f"decode memory traffic against the roofline (the copy bandwidth measured at start: "
                        f"{copy}, read + write)", columns, row,
                        caption="MB/step: what a decode step must read (every weight once, the LM head whole; the KV "
                                "cache at the mean context); GB/s: that over the step's time")
