"""``opsd-rollout compare BEFORE.json AFTER.json``: two result files config by config, a table, notes, and an exit
status that says what was found. Light at import: the comparison's statistics load when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from opsd_rollout.bench.pace import PACE_JUDGEMENTS
from opsd_rollout.bench.report import load_document
from opsd_rollout.cli.common import console
from opsd_rollout.files import write_text_atomic


def run_compare(args: argparse.Namespace) -> int:
    from opsd_rollout.bench.compare import compare_documents
    from opsd_rollout.bench.compare_report import comparison_markdown, comparison_notes, comparison_table, footnote

    if args.threshold < 0:
        raise ValueError(f"--threshold must be >= 0 (percent); got {args.threshold}")
    ignore = tuple(a.strip() for a in args.ignore_axes.split(",") if a.strip()) if args.ignore_axes else ()
    comparison = compare_documents(load_document(args.before), load_document(args.after),
                                   threshold_pct=args.threshold, ignore=ignore, allow_disturbed=args.allow_disturbed,
                                   pace=args.pace)
    out = console()
    if comparison.changes:
        out.print(comparison_table(comparison, out.width))
    out.print(footnote(args.threshold), markup=False, highlight=False)
    for note in comparison_notes(comparison):  # notes quote values and reasons: no markup
        out.print(f"note: {note}", markup=False, highlight=False)
    if args.markdown:
        write_text_atomic(args.markdown, comparison_markdown(comparison, args.threshold))
    status = comparison.exit_status(args.allow_partial)
    out.print(compare_summary(comparison, status, args.threshold))
    return status


def compare_summary(comparison: Any, status: int, threshold: float) -> str:
    """The last line of ``compare``: what its exit status means."""
    from opsd_rollout.bench.compare import EXIT_DISTURBED, EXIT_NOTHING_COMPARED, EXIT_PARTIAL, EXIT_REGRESSION

    disturbed = len(comparison.disturbed)
    widened = len({c.key for c in comparison.changes if not c.by_processes})
    how = (f" (judged over iterations, widened: {widened} config(s) with too few processes a side, see the first "
           "note)") if widened else ""
    if status == EXIT_NOTHING_COMPARED:
        return ("[bold red]nothing compared: no config is measured in both files[/] (match across an axis with "
                "--ignore-axes)")
    if status == EXIT_REGRESSION:
        return f"[bold red]{len(comparison.regressions)} regression(s) beyond {threshold:g}%[/]{how}"
    if status == EXIT_DISTURBED:
        judged = comparison.matched - disturbed
        return (f"[bold yellow]disturbed: {disturbed} of {comparison.matched} compared config(s) were disturbed and "
                "are not judged[/] (rerun on a quiet machine, or --allow-disturbed judges them)"
                + (f"; no regression beyond {threshold:g}% in the {judged} judged{how}" if judged else ""))
    judged = f" ({disturbed} disturbed, judged anyway)" if disturbed else ""
    if status == EXIT_PARTIAL:
        return (f"[bold red]partial: {len(comparison.only_before)} config(s) only in BEFORE, "
                f"{len(comparison.only_after)} only in AFTER[/] (--allow-partial accepts that); "
                f"no regression beyond {threshold:g}% in the {comparison.matched} compared{judged}{how}")
    return f"{comparison.matched} config(s) compared: no regression beyond {threshold:g}%{judged}{how}"


def add_compare_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    compare = sub.add_parser(
        "compare", parents=[common], help="compare two result files; exit 1 on a regression",
        description="Compare two result files config by config: each metric's Hodges-Lehmann ratio (after / "
        "before) with its 95% distribution-free confidence interval over the processes' medians where both files "
        "measured the config in 4 or more processes (--processes), else over the raw iterations, widened by 20% each "
        "way for the spread between processes they cannot show. Where both files timed the reference workload "
        "beside every iteration (a fixed piece of plain torch work: the machine's pace), a note says how far it "
        "moved, and a time is a regression only where it is one both as measured and adjusted for that pace (--pace "
        "both, the default). The files must have measured the same work (model, settings other than warm-up and "
        "iterations, ranks); configs match on every axis. A config disturbed on either side (the run's interference "
        "record) is not judged. Exit status, the first that applies: 2 bad input (also: files of different work, "
        "naming what differs); 3 nothing compared (no config in both files); 1 a regression (the whole interval "
        "worse than --threshold); 5 a compared config was disturbed and not judged (unless --allow-disturbed); 4 one "
        "file has configs the other lacks (unless --allow-partial); 0 compared, no regression.")
    compare.add_argument("before", metavar="BEFORE.json")
    compare.add_argument("after", metavar="AFTER.json")
    compare.add_argument("--threshold", type=float, default=5.0,
                         help="percent: a regression's whole confidence interval is worse than this, and it moves "
                         "at least 1 ms (times) or 1 MiB (memory) (default %(default)s)")
    compare.add_argument("--markdown", metavar="FILE", help="also write the comparison as a Markdown table")
    compare.add_argument("--ignore-axes", metavar="LIST", help="config axes to leave out when matching BEFORE and "
                         "AFTER, e.g. strategy (to compare generate against static), or settings allowed to "
                         "differ, e.g. model")
    compare.add_argument("--allow-disturbed", action="store_true", help="judge configs that were disturbed while "
                         "they ran too (exit 5 otherwise)")
    compare.add_argument("--pace", choices=PACE_JUDGEMENTS, default="both",
                         help="what a time is judged by where both files timed the reference workload beside every "
                         "iteration (the machine's pace): measured, the times as measured; adjusted, each process's "
                         "times adjusted for its reference (a covariate adjustment, as A/B tests use: narrower "
                         "intervals); both, a regression only where both judge one (default %(default)s; "
                         "docs/BENCHMARKS.md)")
    compare.add_argument("--allow-partial", action="store_true", help="exit 0 (not 4) when one file has configs "
                         "the other lacks")
    compare.set_defaults(func=run_compare)
