"""``make perf``: the regression guard. Not a test, and not run by CI: a check to run on a quiet machine before
landing a change to the engine, the loss or the step, whose last line goes in the change's closing note.

It runs the kernel benchmarks (``scripts/kernels.py``), the smoke bench (what ``make bench`` runs) and a bench of each
seeded workload file in ``benchmarks/perf/`` (``NAME.toml``: shapes and seed, ``opsd-rollout bench --config``), each
config in ``PROCESSES`` fresh processes of ``ITERATIONS`` iterations, into ``perf-results/``, and compares each with
its committed baseline in ``benchmarks/perf/`` as ``opsd-rollout compare`` does: per config and metric the
Hodges-Lehmann ratio over the processes' medians with its 95% interval, a regression being a whole interval worse than
the threshold (``docs/BENCHMARKS.md``, "Comparing runs"). A same-code rerun differs between processes, not only between
iterations, and the interval covers that, so a flag needs no second run to be believed. It prints what regressed,
the smallest slowdown each suite could have flagged, and one verdict, its last line. Exit status: 0 no regression
(every config judged), 1 a regression, 2 a suite that could not run or compare (one without a baseline too), 3 no
verdict (configs disturbed while they ran: rerun on a quiet machine).

``--update`` records this machine's results as the new baselines (do it on a quiet machine, and say so in the
commit): a baseline belongs to the machine that made it, which ``benchmarks/perf/MACHINE.txt`` names.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BASELINES = ROOT / "benchmarks" / "perf"
PROCESSES, ITERATIONS = 6, 3
"""Each config in 6 fresh processes of 3 iterations: 6 a side bound the interval over processes well inside the
5% threshold for a config whose processes are a few percent apart (the Moses interval at 6 against 6 cuts 5 of the
36 pairs from each end; at 4 against 4 it spans all 16), and the iterations only steady each process's
median. The run's cost, about 9 minutes on 2 quiet cores, is in README.md ("make perf")."""
SUITES = {
    "kernels": [str(ROOT / "scripts" / "kernels.py"), "--warmup-max-seconds", "10"],
    "bench": ["-m", "opsd_rollout", "bench"],
    **{path.stem: ["-m", "opsd_rollout", "bench", "--config", str(path)] for path in sorted(BASELINES.glob("*.toml"))},
}
"""A suite's name -> what runs it after ``python``: the kernels and the smoke bench at their defaults (the committed
matrix), and a bench of each workload file in ``benchmarks/perf/`` (``NAME.toml``, compared with ``NAME.json``). The
kernels' warm-up stops at 10 s a config (the attention and profiling kernels took 14 and 21 s of the 60 allowed, the
second never steady), which keeps the kernels and the smoke bench under 10 minutes with their 6 processes."""
BUSY_LOAD = 1.5
"""A 1-minute load average above this when perf starts: configs will likely be disturbed, and not judged."""


def python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, text=True, capture_output=True)


def run(name: str, output: Path) -> bool:
    """Run suite ``name`` into ``output``; whether it ran."""
    command = [*SUITES[name], "--processes", str(PROCESSES), "--iterations", str(ITERATIONS), "--output", str(output)]
    print(f"perf: {name}: running (python {' '.join(command)})", flush=True)
    ran = python(*command)
    if ran.returncode != 0:
        print(f"perf: {name}: the run failed (exit {ran.returncode}):\n{ran.stderr[-2000:]}", file=sys.stderr)
    return ran.returncode == 0


def judge(name: str, out: Path, threshold: float) -> tuple[int, Any]:
    """Compare suite ``name``'s result with its baseline (writing the whole comparison as Markdown beside it); the
    exit status ``compare`` would give (2: could not) and the comparison."""
    from opsd_rollout.bench.compare import compare_documents
    from opsd_rollout.bench.compare_report import comparison_markdown
    from opsd_rollout.bench.report import load_document

    baseline = BASELINES / f"{name}.json"
    if not baseline.is_file():
        print(f"perf: {name}: no baseline at {baseline.relative_to(ROOT)}; record one with --update")
        return 2, None
    try:
        comparison = compare_documents(load_document(baseline), load_document(out / f"{name}.json"),
                                       threshold_pct=threshold)
    except ValueError as error:
        print(f"perf: {name}: compare refused the files: {error}", file=sys.stderr)
        return 2, None
    table = out / f"{name}.md"
    table.write_text(comparison_markdown(comparison, threshold))
    status = comparison.exit_status(allow_partial=True)
    print(f"perf: {name}: {summary(comparison, status, threshold)} (the whole comparison: {table})")
    for change in comparison.regressions:
        print(f"  {change.label}: {change.metric} {change.before:.4g} -> {change.after:.4g} "
              f"({change.change_pct:+.1f}%, interval {change.low:.3f}-{change.high:.3f})")
    for note in comparison.notes:
        if "widened" in note:
            print(f"  note: {note}")
    return status, comparison


def summary(comparison: Any, status: int, threshold: float) -> str:
    """One suite's outcome (``status``: ``compare``'s exit status), with the smallest slowdown it could have
    flagged."""
    from opsd_rollout.bench.compare import flaggable_pct

    if status == 3:
        return "nothing compared"
    judged = [c for c in comparison.changes if c.judged and c.metric in ("total_ms", "kernel_ms")]
    flaggable = sorted(p for c in judged if (p := flaggable_pct(c, threshold)) is not None)
    could = (f"; it could flag a slowdown of {flaggable[len(flaggable) // 2]:.0f}% and more (the median config's "
             f"total, {flaggable[0]:.0f}% at best)") if flaggable else ""
    if status == 1:
        return f"REGRESSED: {len(comparison.regressions)} regression(s){could}"
    if status == 5:
        return f"{len(comparison.unjudged)} config(s) disturbed while they ran, not judged{could}"
    return f"no regression in {comparison.matched} config(s){could}"


def verdict(statuses: dict[str, int], seconds: float, load: float | None) -> tuple[int, str]:
    """The run's one verdict: its exit status and its last line."""
    took = f"{seconds / 60:.1f} min" + (f", load {load:.1f} at the start" if load is not None else "")
    if any(s == 1 for s in statuses.values()):
        flagged = ", ".join(name for name, s in statuses.items() if s == 1)
        return 1, f"perf: REGRESSION ({flagged}): beyond the threshold over the spread between processes ({took})"
    if any(s in (2, 3) for s in statuses.values()):
        failed = ", ".join(name for name, s in statuses.items() if s in (2, 3))
        return 2, f"perf: NO VERDICT: {failed} could not run or compare ({took})"
    if any(s == 5 for s in statuses.values()):
        return 3, (f"perf: NO VERDICT: configs were disturbed while they ran (other processes took the CPU); rerun on "
                   f"a quiet machine ({took})")
    return 0, f"perf: no regression ({took})"


def update(out: Path, suites: list[str]) -> None:
    BASELINES.mkdir(parents=True, exist_ok=True)
    for name in suites:
        shutil.copyfile(out / f"{name}.json", BASELINES / f"{name}.json")
    (BASELINES / "MACHINE.txt").write_text(
        f"Baselines of `make perf`, recorded with `python scripts/perf.py --update` on: {platform.node() or 'a'} "
        f"({platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}); results on another machine "
        "are compared against these only after recording its own.\n")
    print(f"perf: baselines recorded in {BASELINES.relative_to(ROOT)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suites", default=",".join(SUITES), help=f"comma list of {', '.join(SUITES)}")
    parser.add_argument("--threshold", type=float, default=5.0, help="percent, as compare's (default 5)")
    parser.add_argument("--output-dir", default=str(ROOT / "perf-results"), help="where the runs are written")
    parser.add_argument("--update", action="store_true", help="record the results as the new baselines")
    args = parser.parse_args(argv)
    suites = [s for s in args.suites.split(",") if s]
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        parser.error(f"--suites: unknown {', '.join(unknown)}; known: {', '.join(SUITES)}")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if load is not None and load > BUSY_LOAD:
        print(f"perf: the machine is busy (load {load:.1f} on {os.cpu_count()} cores): configs it disturbs are not "
              "judged; run it on a quiet machine", flush=True)
    start = time.monotonic()
    ran = {name: run(name, out / f"{name}.json") for name in suites}
    if args.update:
        if not all(ran.values()):
            return 2
        update(out, suites)
        return 0
    statuses = {name: judge(name, out, args.threshold)[0] if ran[name] else 2 for name in suites}
    status, line = verdict(statuses, time.monotonic() - start, load)
    (out / "verdict.json").write_text(json.dumps({"status": status, "verdict": line, "suites": statuses}) + "\n")
    print(line)
    return status


if __name__ == "__main__":
    sys.exit(main())
