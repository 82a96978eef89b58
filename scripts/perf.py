"""``make perf``: the regression guard. Not a test, and not run by CI: a check to run on a quiet machine before
landing a change to the engine, the loss or the step, whose output goes in the change's closing note.

It runs the kernel benchmarks (``scripts/kernels.py``) and the smoke bench (what ``make bench`` runs) into
``perf-results/``, compares each with its committed baseline in ``benchmarks/perf/`` through ``opsd-rollout compare``
(Hodges-Lehmann ratios with their confidence intervals over the raw iterations, a regression being a whole interval
worse than the threshold), and prints, per suite, what regressed beyond noise, what it could not judge (configs
disturbed while they ran) and where the full comparison is. Exit status: 0 no regression, 1 a regression, 2 a suite that could not run or compare.

``--update`` records this machine's results as the new baselines (do it on a quiet machine, and say so in the
commit): a baseline belongs to the machine that made it, which ``benchmarks/perf/MACHINE.txt`` names.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINES = ROOT / "benchmarks" / "perf"
SUITES = {
    "kernels": [str(ROOT / "scripts" / "kernels.py")],
    "bench": ["-m", "opsd_rollout", "bench"],
}
"""A suite's name -> what runs it after ``python`` (each at its defaults: the committed matrix)."""
VERDICTS = {0: "no regression", 1: "REGRESSED", 3: "nothing compared", 4: "configs differ",
            5: "no regression among the configs judged; some were disturbed and not judged"}


def python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, text=True, capture_output=True)


def run_suite(name: str, out: Path, threshold: float) -> int:
    """Run one suite and compare it with its baseline; the exit status ``compare`` gave (or 2)."""
    result = out / f"{name}.json"
    print(f"perf: {name}: running ({' '.join(SUITES[name])})", flush=True)
    ran = python(*SUITES[name], "--output", str(result))
    if ran.returncode != 0:
        print(f"perf: {name}: the run failed (exit {ran.returncode}):\n{ran.stderr[-2000:]}", file=sys.stderr)
        return 2
    baseline = BASELINES / f"{name}.json"
    if not baseline.is_file():
        print(f"perf: {name}: no baseline at {baseline.relative_to(ROOT)}; record one with --update")
        return 2
    compared = python("-m", "opsd_rollout", "compare", str(baseline), str(result), "--threshold", str(threshold),
                      "--allow-partial", "--markdown", str(out / f"{name}.md"))
    if compared.returncode == 2:
        print(f"perf: {name}: compare refused the files: {compared.stderr.strip()}", file=sys.stderr)
        return 2
    verdict = VERDICTS.get(compared.returncode, f"compare exit {compared.returncode}")
    table = out / f"{name}.md"
    print(f"perf: {name}: {verdict} (the whole comparison: {table})")
    for row in table.read_text().splitlines():
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        if "REGRESSION" in cells[6:7]:  # config, metric, before, after, change, interval, verdict[, disturbed]
            print(f"  {cells[0]}: {cells[1]} {cells[2]} -> {cells[3]} ({cells[4]}, ratio {cells[5]})")
    return compared.returncode


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
    if args.update:
        for name in suites:
            print(f"perf: {name}: running ({' '.join(SUITES[name])})", flush=True)
            ran = python(*SUITES[name], "--output", str(out / f"{name}.json"))
            if ran.returncode != 0:
                print(f"perf: {name}: the run failed:\n{ran.stderr[-2000:]}", file=sys.stderr)
                return 2
        update(out, suites)
        return 0
    statuses = [run_suite(name, out, args.threshold) for name in suites]
    if 1 in statuses:
        return 1
    return 2 if 2 in statuses else 0


if __name__ == "__main__":
    sys.exit(main())
