"""``make perf``: the regression guard. Not a test, and not run by CI: a check to run on a quiet machine before
landing a change to the engine, the loss or the step, whose last line goes in the change's closing note.

It runs the kernel benchmarks (``scripts/bench_kernels.py``), the smoke bench (what ``make bench`` runs) and a bench of
each seeded workload file in ``benchmarks/perf/`` (``NAME.toml``: shapes and seed, ``opsd-rollout bench --config``),
each config in ``PROCESSES`` fresh processes of ``ITERATIONS`` iterations, into ``perf-results/``, and compares each
with its committed baseline in ``benchmarks/perf/`` as ``opsd-rollout compare`` does: per config and metric the
Hodges-Lehmann ratio over the processes' medians with its 95% interval, a regression being a whole interval worse than
the threshold (``docs/BENCHMARKS.md``, "Comparing runs"). A same-code rerun differs between processes, not only between
iterations, and the interval covers that; what it cannot cover is a host that slows every process of a run alike, which
no counter shows (a VM's neighbour: one same-code pair in 10 of the smoke bench, RESULTS, "The 10 pairs"), and a
baseline recorded days before took none of that. So a suite flagged against its baseline is settled in the same
invocation: measured again beside the commit that recorded its baseline, the two taking turns process by process
(``settle``, as ``--against`` does), and the same-run comparison decides; ``--no-settle`` leaves the flag as it is. It
prints what regressed, the smallest slowdown each suite could have flagged, and one verdict, its last line, which needs
no rerun. Exit status: 0 no regression (every config judged; a flag the settling run cleared too), 1 a regression
(confirmed beside the baselines' revision, or one that could not be settled, the line says why), 2 a suite that could
not run or compare (one without a baseline too), 3 no verdict (configs disturbed while they ran: rerun on a quiet
machine). ``verdict.json`` in the output directory keeps the verdict, each suite's status against the baselines and each
settling.

``--update`` records this machine's results as the new baselines (do it on a quiet machine, and say so in the
commit): a baseline belongs to the machine that made it, which ``benchmarks/perf/MACHINE.txt`` names.

``--against REV`` measures another revision in the same run instead of reading the baselines: REV's tree (``git
archive``) in ``perf-results/against/tree/`` and its results beside it, its workers started with its ``src/`` and
``scripts/`` first on the path, and the two revisions take turns process by process (``run_alternating``), so a
machine that slows mid-run slows both alike; then each suite of this checkout is judged against REV's. Twice the
processes, so about twice the minutes: ``--suites`` narrows it. REV's workers read this checkout's jobs (``python -m
opsd_rollout.bench.processes``, from issue 52 on): the matrix, settings and config keys as this checkout writes them,
so a change that adds a bench setting or axis, or renames a config key, leaves REV's configs failed and the suite
with no verdict (REV's error printed); time such a change against the baselines.

``--processes N`` measures each config in N processes a side instead of ``PROCESSES`` (the minutes grow with it) and
``--pace`` judges as ``compare --pace`` (both ways by default; as measured, or adjusted for the machine's pace), in
the run and its settling: ``--against REV --processes 12`` judged both ways gave no false alarm in 20 same-code pairs
of each bench and flagged a planted 15% slowdown in all of them, issue 52's goal (RESULTS, "Both ways"), at about 4
times ``make perf``'s processes.
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
PROCESSES, ITERATIONS, WARMUP = 6, 2, 1
"""Each config in 6 fresh processes of 1 warm-up call and 2 measured iterations: 6 a side bound the interval over
processes well inside the 5% threshold for a config whose processes are a few percent apart (the Moses interval at 6
against 6 cuts 5 of the 36 pairs from each end; at 4 against 4 it spans all 16); the processes are the units, and 2
iterations steady a process's median about as well as 3 (in the baselines recorded at 3, the processes' IQR/median
from the first 2 iterations moved against all 3 by -16 to +8 points, 15 configs). One warm-up call: warming up until
two calls agreed within 5% stopped after the second call for most configs (the first call was steady already), and
took 10-46 s of the 60 allowed for the slow ones (the kernels' attention and profiling, the long prompt, the long
tail), whatever the warm-up leaves biasing both sides of a comparison alike. The run's cost is in README.md ("make
perf")."""
SUITES = {
    "kernels": ("kernels", ["--response-lengths", "16"]),
    "bench": ("bench", []),
    **{path.stem: ("bench", ["--config", str(path)]) for path in sorted(BASELINES.glob("*.toml"))},
}
"""A suite's name -> its benchmark command and arguments: the kernels (``scripts/bench_kernels.py``) at their
defaults but 16 new tokens (the rollouts of attention and profiling, and the loss's rows, half as long), the smoke bench
at its defaults (the committed matrix), and a bench of each workload file in ``benchmarks/perf/``
(``NAME.toml``, compared with ``NAME.json``), sized for perf's minutes (issue 51's full-size workloads are in
``benchmarks/rollout-lead/workloads/``). Every suite is measured by the same 6 fresh processes (``run_together``),
each running every suite's configs in turn: 6 interpreters' start instead of 6 a suite."""
BUSY_LOAD = 1.5
"""A 1-minute load average above this when perf starts: configs will likely be disturbed, and not judged."""


def suite_command(name: str, processes: int | None = None) -> tuple[Any, list[str]]:
    """Suite ``name``'s ``BenchCommand`` and its arguments, with perf's processes (or ``processes``), iterations and
    warm-up."""
    from opsd_rollout.cli.bench import COMMANDS

    command_name, argv = SUITES[name]
    if command_name == "kernels":
        from kernel_bench.cli import COMMAND  # scripts/: on the path when this script runs
    else:
        COMMAND = next(c for c in COMMANDS if c.name == command_name)
    return COMMAND, [*argv, "--processes", str(processes or PROCESSES), "--iterations", str(ITERATIONS),
                     "--warmup", str(WARMUP)]


def checkout(rev: str, out: Path) -> tuple[Path, str]:
    """REV's tree, fresh, in ``out`` (``git archive``: no worktree to clean up) and its commit. Raises
    ``ValueError`` naming REV when git does not know it."""
    found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise ValueError(f"--against: {rev!r} is no commit of {ROOT} (git rev-parse found none)")
    commit = found.stdout.strip()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit], capture_output=True,
                             check=True)
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    (out / "COMMIT").write_text(commit + "\n")
    return out, commit


def against_launcher(tree: Path) -> Any:
    """Shared workers that run ``tree``'s code: its ``src/`` and ``scripts/`` before anything else on the path."""
    from opsd_rollout.bench.processes import shared_subprocess_launcher

    path = os.pathsep.join([str(tree / "src"), str(tree / "scripts"), *filter(None, [os.environ.get("PYTHONPATH")])])
    return shared_subprocess_launcher(env={**os.environ, "PYTHONPATH": path}, cwd=tree)


def tree_path(import_path: str | None, tree: Path) -> str:
    """Where ``tree`` keeps what this checkout imports from ``import_path`` (``src/`` or ``scripts/``)."""
    if import_path is None or not Path(import_path).resolve().is_relative_to(ROOT):
        raise ValueError(f"--against needs the package imported from this checkout's src/ (it came from "
                         f"{import_path}): install it editable (make install), or run from the checkout")
    return str(tree / Path(import_path).resolve().relative_to(ROOT))


def package_path_in(tree: Path) -> str:
    """Where ``tree`` keeps the package this process imports (``ValueError`` when it is not this checkout's): its
    side of a run imports from there what this side imports from this checkout."""
    import opsd_rollout

    return tree_path(str(Path(opsd_rollout.__file__).resolve().parents[1]), tree)


def run(names: list[str], out: Path, against: Path | None = None, processes: int | None = None) -> dict[str, bool]:
    """Every suite of ``names`` measured by the same ``processes`` (default ``PROCESSES``) fresh processes, into
    ``out/NAME.json``; per suite whether every config was measured (a failure's error printed). With ``against``
    (another revision's tree), that revision too, into ``NAME.json`` beside the tree, its processes taking turns with
    this checkout's."""
    from opsd_rollout.bench.processes import ProcessRunner, run_alternating, shared_subprocess_launcher
    from opsd_rollout.cli.bench import matrix_of

    processes = processes or PROCESSES
    runners, others = {}, {}
    for name in names:
        command, argv = suite_command(name, processes)
        script = "scripts/bench_kernels.py" if command.name == "kernels" else f"-m opsd_rollout {command.name}"
        alone = f"python {script}"
        print(f"perf: {name}: {alone} {' '.join(argv)} --output {out / f'{name}.json'}", flush=True)
        try:
            matrix, settings = matrix_of(command, argv)
        except ValueError as error:
            print(f"perf: {name}: cannot run: {error}", file=sys.stderr)
            continue
        (out / f"{name}.json").unlink(missing_ok=True)  # a fresh measurement, never a resumed one
        runners[name] = ProcessRunner(matrix, settings, output=out / f"{name}.json")
        if against is not None:
            (against.parent / f"{name}.json").unlink(missing_ok=True)
            others[name] = ProcessRunner(matrix, settings, output=against.parent / f"{name}.json",
                                         import_path=tree_path(runners[name].import_path, against))
    start = time.monotonic()
    sides = [(list(runners.values()), shared_subprocess_launcher())]
    if against is not None:
        sides.append((list(others.values()), against_launcher(against)))
        print(f"perf: {len(runners)} suite(s) of this checkout and of {against}, each config in {processes} fresh "
              "processes a side, the sides taking turns", flush=True)
    else:
        print(f"perf: {len(runners)} suite(s), each config in the same {processes} fresh processes", flush=True)
    run_alternating(sides)
    print(f"perf: measured in {(time.monotonic() - start) / 60:.1f} min", flush=True)
    ran = {}
    for name in names:
        failed = None
        if name in runners:
            failed = [(side, r) for side, group in (("", runners), (f" ({against})", others)) if name in group
                      for r in group[name].results.values() if r.status == "failed"]
        for side, result in failed or []:
            print(f"perf: {name}{side}: {result.config.key} failed: {result.error}", file=sys.stderr)
        ran[name] = failed == []
    return ran


def judge(name: str, out: Path, threshold: float, baselines: Path | None = None,
          label: str | None = None, pace: str = "both") -> tuple[int, Any]:
    """Compare suite ``name``'s result with its baseline in ``baselines`` (``None``: the committed ones; writing the
    whole comparison as Markdown beside the result); the exit status ``compare`` would give (2: could not) and the
    comparison. ``label`` names the suite in what is printed (default ``name``); ``pace`` judges as ``compare
    --pace``."""
    from opsd_rollout.bench.compare import compare_documents
    from opsd_rollout.bench.compare_report import comparison_markdown
    from opsd_rollout.bench.report import load_document
    from opsd_rollout.files import write_text_atomic

    label = label or name

    baseline = (baselines or BASELINES) / f"{name}.json"
    if baselines is not None and not baseline.is_file():
        print(f"perf: {label}: {baselines} measured nothing")
        return 2, None
    if not baseline.is_file():
        print(f"perf: {name}: no baseline at {baseline.relative_to(ROOT)}; record one with --update")
        return 2, None
    try:
        comparison = compare_documents(load_document(baseline), load_document(out / f"{name}.json"),
                                       threshold_pct=threshold, pace=pace)
    except ValueError as error:
        print(f"perf: {label}: compare refused the files: {error}", file=sys.stderr)
        return 2, None
    table = out / f"{name}.md"
    write_text_atomic(table, comparison_markdown(comparison, threshold))
    status = comparison.exit_status(allow_partial=True)
    print(f"perf: {label}: {summary(comparison, status, threshold)} (the whole comparison: {table})")
    for change in comparison.regressions:
        print(f"  {change.label}: {change.metric} {change.before:.4g} -> {change.after:.4g} "
              f"({change.change_pct:+.1f}%, interval {change.low:.3f}-{change.high:.3f})")
    for note in comparison.notes:  # how the units were judged, and how far the machine moved (a flag to recheck)
        if "widened" in note or note.startswith("the machine's pace"):
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


def verdict(statuses: dict[str, int], seconds: float, load: float | None, against: str | None = None,
            settled: dict[str, tuple[int, str]] | None = None) -> tuple[int, str]:
    """The run's one verdict (``against``: the revision it was judged against, not the baselines): its exit status
    and its last line. ``settled``: for each suite flagged against the baselines, the status of its settling run
    beside the baselines' revision (``settle``) and that revision, or 2 and why it was not settled; a cleared flag
    (0) is no regression, a confirmed one (1) and one that could not be settled (2, 3, 5) stay regressions."""
    settled = settled or {}
    took = (f"against {against}, " if against else "") + f"{seconds / 60:.1f} min" + (
        f", load {load:.1f} at the start" if load is not None else "")
    cleared = [name for name, (status, _) in settled.items() if status == 0]
    statuses = {name: 0 if name in cleared else status for name, status in statuses.items()}
    notes = [f"{name}'s flag against the baselines was not confirmed beside {settled[name][1]} in the same run"
             for name in cleared]
    if any(s == 1 for s in statuses.values()):
        def how(name: str) -> str:
            if name not in settled:
                return name
            status, said = settled[name]
            return (f"{name}, confirmed beside {said} in the same run" if status == 1
                    else f"{name}, against the baselines; not settled: {said}")
        flagged = "; ".join(how(name) for name, s in statuses.items() if s == 1)
        return 1, (f"perf: REGRESSION ({flagged}): beyond the threshold over the spread between processes "
                   f"({'; '.join([*notes, took])})")
    if any(s in (2, 3) for s in statuses.values()):
        failed = ", ".join(name for name, s in statuses.items() if s in (2, 3))
        return 2, f"perf: NO VERDICT: {failed} could not run or compare ({took})"
    if any(s == 5 for s in statuses.values()):
        return 3, (f"perf: NO VERDICT: configs were disturbed while they ran (other processes or the hypervisor took "
                   f"CPU time: each config's reasons are in its result); rerun on "
                   f"a quiet machine ({took})")
    return 0, f"perf: no regression ({'; '.join([*notes, took])})"


def baseline_revision(name: str) -> tuple[str | None, str]:
    """The commit that last wrote suite ``name``'s committed baseline, the code its baseline measured; or ``None``
    and why there is none (the baseline not committed, or changed since)."""
    path = BASELINES / f"{name}.json"
    if not path.resolve().is_relative_to(ROOT):
        return None, f"its baseline {path} is outside this checkout"
    relative = str(path.resolve().relative_to(ROOT))
    git = ["git", "-C", str(ROOT)]
    if subprocess.run([*git, "status", "--porcelain", "--", relative], capture_output=True, text=True).stdout.strip():
        return None, f"{relative} has changes not committed, so no revision measured it"
    commit = subprocess.run([*git, "log", "-1", "--format=%H", "--", relative], capture_output=True, text=True)
    if commit.returncode != 0 or not commit.stdout.strip():
        return None, f"{relative} is in no commit"
    return commit.stdout.strip(), ""


def settle(flagged: list[str], out: Path, threshold: float, processes: int | None = None,
           pace: str = "both") -> dict[str, tuple[int, str]]:
    """Each suite flagged against its baseline measured again beside the revision that recorded the baseline, the
    two taking turns process by process in one run (``run`` with ``against``), into ``out/settle/``, and judged
    against that revision's results: a baseline recorded days before took none of the machine's drift since, the
    same-run side takes all of it. Per suite the settling run's status (``compare``'s: 1 confirmed, 0 cleared, 5
    disturbed) and the revision, or 2 and why it could not be settled."""
    settled: dict[str, tuple[int, str]] = {}
    revisions: dict[str, list[str]] = {}
    for name in flagged:
        commit, why = baseline_revision(name)
        if commit is None:
            settled[name] = (2, why)
        else:
            revisions.setdefault(commit, []).append(name)
    for commit, names in revisions.items():
        where = out / "settle" / commit[:10]
        where.mkdir(parents=True, exist_ok=True)
        tree, _ = checkout(commit, where / "against" / "tree")
        try:
            package_path_in(tree)
        except ValueError as error:
            settled.update({name: (2, str(error)) for name in names})
            continue
        print(f"perf: settling {', '.join(names)}: measured again beside {commit[:10]}, the revision that recorded "
              "the baseline, in one run (--no-settle skips this)", flush=True)
        ran = run(names, where, tree, processes)
        for name in names:
            status = (judge(name, where, threshold, tree.parent, f"{name} beside {commit[:10]}", pace)[0]
                      if ran[name] else 2)
            settled[name] = (status, commit[:10]) if status in (0, 1) else (
                2, f"the settling run beside {commit[:10]} " + ("was disturbed" if status == 5 else "failed"))
    return settled


def disturbed_configs(result: Path) -> list[str]:
    """The configs of a result file that were disturbed while they ran (in any process)."""
    return [r["key"] for r in json.loads(result.read_text()).get("results", [])
            if (r.get("interference") or {}).get("disturbed")]


def update(out: Path, suites: list[str]) -> int:
    """Record the suites' results as the baselines, unless a config was disturbed while it ran: a disturbed baseline
    config is never judged, so every later run of perf would give no verdict on it. 0 recorded, 3 refused (the
    baselines unchanged)."""
    disturbed = {name: keys for name in suites if (keys := disturbed_configs(out / f"{name}.json"))}
    if disturbed:
        print("perf: baselines NOT recorded: configs were disturbed while they ran (other processes or the hypervisor "
              "took CPU time), and a disturbed baseline is never judged: "
              + "; ".join(f"{name}: {', '.join(keys)}" for name, keys in disturbed.items())
              + ". Rerun --update on a quiet machine", file=sys.stderr)
        return 3
    from opsd_rollout.files import write_text_atomic

    BASELINES.mkdir(parents=True, exist_ok=True)
    for name in suites:
        write_text_atomic(BASELINES / f"{name}.json", (out / f"{name}.json").read_text())
    write_text_atomic(BASELINES / "MACHINE.txt", (
        f"Baselines of `make perf`, recorded with `python scripts/perf.py --update` on: {platform.node() or 'a'} "
        f"({platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}); results on another machine "
        "are compared against these only after recording its own.\n"))
    print(f"perf: baselines recorded in {BASELINES.relative_to(ROOT)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from opsd_rollout.bench.pace import PACE_JUDGEMENTS
    from opsd_rollout.files import write_json_atomic

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suites", default=",".join(SUITES), help=f"comma list of {', '.join(SUITES)}")
    parser.add_argument("--threshold", type=float, default=5.0, help="percent, as compare's (default 5)")
    parser.add_argument("--output-dir", default=str(ROOT / "perf-results"), help="where the runs are written")
    parser.add_argument("--update", action="store_true", help="record the results as the new baselines")
    parser.add_argument("--against", metavar="REV",
                        help="judge against git revision REV measured in this same run, its processes taking turns "
                             "with this checkout's (about twice the minutes), instead of the baselines")
    parser.add_argument("--processes", type=int,
                        help=f"fresh processes a config and side (default {PROCESSES}); more narrow the interval, and "
                             "take minutes in proportion")
    parser.add_argument("--pace", choices=PACE_JUDGEMENTS, default="both",
                        help="judge as compare --pace does: the times as measured, adjusted for the reference "
                             "workload's pace, or both (default %(default)s)")
    parser.add_argument("--no-settle", action="store_true",
                        help="leave a flag against the baselines as it is, instead of measuring the flagged suites "
                             "again beside the baselines' revision in the same run")
    args = parser.parse_args(argv)
    from opsd_rollout.bench.compare import FEWEST_PROCESSES

    if args.processes is not None and args.processes < FEWEST_PROCESSES:
        parser.error(f"--processes: at least {FEWEST_PROCESSES}, the fewest compare judges by processes; got "
                     f"{args.processes}")
    if args.against and args.update:
        parser.error("--against and --update: a baseline is recorded from this checkout alone; give one of them")
    suites = [s for s in args.suites.split(",") if s]
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        parser.error(f"--suites: unknown {', '.join(unknown)}; known: {', '.join(SUITES)}")
    out = Path(args.output_dir).resolve()  # absolute: REV's workers start in REV's tree
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if load is not None and load > BUSY_LOAD:
        print(f"perf: the machine is busy (load {load:.1f} on {os.cpu_count()} cores): configs it disturbs are not "
              "judged; run it on a quiet machine", flush=True)
    against, named = None, None
    if args.against:
        try:
            against, commit = checkout(args.against, out / "against" / "tree")
            package_path_in(against)
        except ValueError as error:
            parser.error(str(error))
        named = f"{args.against} ({commit[:10]})" if not commit.startswith(args.against) else commit[:10]
        print(f"perf: against {named}: its tree in {against}", flush=True)
    start = time.monotonic()
    ran = run(suites, out, against, args.processes)
    if args.update:
        if not all(ran.values()):
            return 2
        return update(out, suites)
    baselines = against.parent if against else None
    statuses = {name: judge(name, out, args.threshold, baselines, pace=args.pace)[0]
                if ran[name] else 2 for name in suites}
    flagged = [name for name, s in statuses.items() if s == 1]
    settled = (settle(flagged, out, args.threshold, args.processes, args.pace)
               if flagged and not (args.against or args.no_settle) else {})
    status, line = verdict(statuses, time.monotonic() - start, load, named, settled)
    record = {"status": status, "verdict": line, "suites": statuses,
              "settled": {name: {"status": s, "revision_or_why": said} for name, (s, said) in settled.items()}}
    write_json_atomic(out / "verdict.json", record)
    print(line)
    return status


if __name__ == "__main__":
    sys.exit(main())
