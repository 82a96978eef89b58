"""One-off reproducer of pairs.json beside it (RESULTS.md, issue 52, part 3): can a same-code rerun fool compare?

For each benchmark kind (the smoke bench, ``opsd-rollout bench`` at its defaults as ``make perf`` runs it, and the
step bench, ``opsd-rollout step`` at its defaults), ``--pairs`` pairs of runs of the same code, one fresh run after
another, each config in ``--processes`` processes of ``--warmup`` calls and ``--iterations`` (by default ``make
perf``'s, read from ``scripts/perf.py``); then per pair ``compare``'s judgement of the second run against the first (a regression here is a false alarm), and of a
planted slowdown: the second run's JSON with every time scaled by ``--scale`` (every throughput divided by it), which
must be flagged. Reports per kind how many same-code pairs read as a regression, how many planted ones were flagged,
the smallest slowdown each pair could flag, how far apart the processes of one config were (the largest and the
median ratio of two processes' medians, against compare's 20% allowance for one process a side), and the machine's
load before and after every run (a config disturbed while it ran is not judged: rerun on a quiet machine).

    python benchmarks/variance/same_code_pairs.py --pairs 10 --output benchmarks/variance/pairs.json

Runs are kept in ``--runs-dir`` (default ``bench-results/variance``); a run already there, complete and made at
these settings is not run again, so an interrupted measurement continues where it stopped, and the result is
rewritten (atomically) after every pair. On 2 quiet cores the default took about 2 hours at ``make perf``'s earlier settings (40 runs of 6 processes
of 3 iterations, warm-up until steady: about 3 minutes a smoke run, 2.5 a step run), less at today's 2 iterations
after one warm-up call; ``--kinds rollout`` or ``step`` measures one kind. ``--quick`` rehearses the whole path on a tiny config
(the tiny models, one prompt of 8 tokens, 4 new, 2 processes of 2 iterations, 1 pair unless ``--pairs`` says) in a
few minutes; ``tests/test_variance_pairs.py`` runs it so. ``--interleaved`` makes each pair one run of twice the
processes and deals them to the two sides as ``scripts/perf.py --against REV`` deals two revisions' (A B, B A, ...),
so drift between the runs of a pair lands on both.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
KINDS = {"rollout": ("bench", "--model"), "step": ("step", "--student")}
"""A result's kind -> the subcommand that measures it (each at its defaults: the smoke matrices) and its model's
flag."""
QUICK = {"rollout": ["--model", "llama-tiny", "--zero-stages", "none"],
         "step": ["--student", "llama-tiny", "--teacher", "llama-tiny", "--zero-stages", "0"]}
QUICK_RUN = ["--batch-sizes", "1", "--samples-per-prompt", "1", "--prompt-lengths", "8", "--response-lengths", "4"]
"""``--quick``: each kind's tiny config (a step trains a DeepSpeed engine, so its ZeRO stage is 0, not none)."""


def scaled(document: dict[str, Any], scale: float) -> dict[str, Any]:
    """``document`` with every time of every iteration (the merged view and each process's) times ``scale`` and
    every throughput divided by it, as the machine's pace would move them (``bench/pace.py``), but the reference
    workload's time: the code made ``scale`` times slower on the same machine."""
    from opsd_rollout.bench.pace import paced

    document = json.loads(json.dumps(document))  # a copy whose iterations share no dict, so none is scaled twice
    for result in document["results"]:
        for iterations in [result["iterations"], *(p["iterations"] for p in result.get("processes") or [])]:
            for iteration in iterations:
                for name, value in iteration.items():
                    how = paced(name)
                    if how and isinstance(value, (int, float)) and not isinstance(value, bool):
                        iteration[name] = value * scale if how == "time" else value / scale
    return document


def alternating_sides(count: int) -> tuple[list[int], list[int]]:
    """Which of ``count`` processes in a row each side gets when two sides take turns as ``run_alternating`` starts
    them, the order turning each round (A B, B A, A B, ...): a steady drift then lands on both alike."""
    first = [i for i in range(count) if (i % 2) == (i // 2) % 2]
    return first, [i for i in range(count) if i not in first]


def split_interleaved(document: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One run of 2P processes a config -> two runs of P, its processes dealt as ``run_alternating`` deals two sides'
    (``alternating_sides``): two sides that took turns, as ``scripts/perf.py --against`` runs two revisions (of the
    same code, here)."""
    from opsd_rollout.bench.processes import merge_processes
    from opsd_rollout.bench.report import results_of
    from opsd_rollout.bench.scenarios import scenario_class

    sides = []
    for parity in (0, 1):
        side = json.loads(json.dumps(document))
        rows = []
        for result in results_of(side, scenario_class(side["kind"]).config_type):
            if result.processes:
                result.processes = [result.processes[i] for i in alternating_sides(len(result.processes))[parity]]
                merge_processes(result)
            rows.append(result.to_dict())
        side["results"] = rows
        side["settings"]["processes"] = side["settings"]["processes"] // 2
        sides.append(side)
    return sides[0], sides[1]


def perf_settings() -> dict[str, int]:
    """``make perf``'s processes, iterations and warm-up calls, as ``scripts/perf.py`` sets them."""
    spec = importlib.util.spec_from_file_location("perf_script", ROOT / "scripts" / "perf.py")
    assert spec is not None and spec.loader is not None
    perf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(perf)
    return {"processes": perf.PROCESSES, "iterations": perf.ITERATIONS, "warmup": perf.WARMUP}


def complete(path: Path, args: argparse.Namespace) -> bool:
    """Whether ``path`` holds a finished run (every config measured or failed) made at ``args``' processes,
    iterations and warm-up, with the reference workload timed beside every iteration: one to keep, not to rerun."""
    from opsd_rollout.bench.pace import REFERENCE_METRIC

    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    results = document.get("results") or []
    made = document.get("settings") or {}
    return (bool(results) and all(r["status"] in ("ok", "failed", "skipped") for r in results)
            and all(made.get(name) == getattr(args, name) for name in ("processes", "iterations", "warmup"))
            and all(REFERENCE_METRIC in it for r in results for it in r.get("iterations") or []))


def command_of(kind: str, path: Path, args: argparse.Namespace) -> list[str]:
    subcommand, model = KINDS[kind]
    command = [sys.executable, "-m", "opsd_rollout", subcommand, "--processes", str(args.processes), "--iterations",
               str(args.iterations), "--warmup", str(args.warmup), "--output", str(path)]
    if args.quick:
        return command + QUICK[kind] + QUICK_RUN
    return command + ([model, args.model] if args.model else []) + \
        (["--teacher", args.teacher] if args.teacher and kind == "step" else [])


def run(kind: str, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One run of ``kind`` into ``path`` (kept when a complete one is there): its wall seconds and the load."""
    if complete(path, args):
        return {"path": str(path), "reused": True}
    command = command_of(kind, path, args)
    load, start = os.getloadavg()[0], time.monotonic()
    print(f"same_code_pairs: {' '.join(command[1:])}", flush=True)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                                              os.environ.get("PYTHONPATH")]))}
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=environment)
    if finished.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed (exit {finished.returncode}):\n{finished.stderr[-3000:]}")
    return {"path": str(path), "seconds": time.monotonic() - start, "load_before": load,
            "load_after": os.getloadavg()[0]}


def processes_apart(document: dict[str, Any]) -> list[float]:
    """Per config measured in several processes: the largest ratio of two of its processes' medians of
    ``total_ms``."""
    from opsd_rollout.bench.report import results_of
    from opsd_rollout.bench.scenarios import scenario_class

    results = results_of(document, scenario_class(document["kind"]).config_type)
    medians = [r.process_medians("total_ms") for r in results if r.status == "ok"]
    return [max(m) / min(m) for m in medians if len(m) > 1]


def judged(before: dict[str, Any], after: dict[str, Any], args: argparse.Namespace,
           pace: str = "adjusted") -> dict[str, Any]:
    """``compare``'s judgement of ``after`` against ``before`` at ``compare --pace``'s ``pace`` (``adjusted``: for the
    machine's pace; ``measured``: the times as measured; ``both``: a regression only where both are one): its exit
    status, regressions, disturbed configs, whether every metric was judged over processes and adjusted for the pace,
    the reference's ratio per config, and per config the smallest slowdown its total could have been flagged at and each
    side's spread between processes."""
    from opsd_rollout.bench.compare import compare_documents, flaggable_pct

    comparison = compare_documents(before, after, threshold_pct=args.threshold, allow_disturbed=args.allow_disturbed,
                                   pace=pace)
    totals = [c for c in comparison.changes if c.metric == "total_ms"]
    return {"exit_status": comparison.exit_status(), "paced": any(c.paced for c in comparison.changes),
            "machine": comparison.machine,
            "regressions": [{"config": c.label, "metric": c.metric, "ratio": c.ratio, "low": c.low, "high": c.high}
                            for c in comparison.regressions],
            "disturbed": sorted(comparison.disturbed),
            "by_processes": bool(comparison.changes) and all(c.by_processes for c in comparison.changes),
            "flaggable_pct": {c.label: flaggable_pct(c, args.threshold) for c in totals},
            "between_spread": {c.label: list(c.between) for c in totals}}


JUDGEMENTS = {"": "adjusted", "_as_measured": "measured", "_both": "both"}
"""Each pair is judged three ways from the same runs: the suffix of its entries and counts, and ``compare --pace``."""


def tally(pairs: list[dict[str, Any]], apart: list[float]) -> dict[str, Any]:
    """One kind's pairs and what they add up to (judged adjusted for the machine's pace, ``--pace adjusted``; as
    measured: ``_as_measured``; and both ways, a metric flagged only where both flag it: ``_both``)."""
    counts: dict[str, int] = {}
    for suffix in JUDGEMENTS:
        counts[f"same_code_pairs_with_a_regression{suffix}"] = sum(bool(p[f"same_code{suffix}"]["regressions"])
                                                                    for p in pairs)
        counts[f"planted_pairs_flagged{suffix}"] = sum(bool(p[f"planted{suffix}"]["regressions"]) for p in pairs)
    return {"pairs": pairs, **counts,
            "pairs_with_a_disturbed_config": sum(bool(p["same_code"]["disturbed"]) for p in pairs),
            "largest_ratio_of_two_processes": max(apart, default=None),
            "median_ratio_of_two_processes": sorted(apart)[len(apart) // 2] if apart else None}


def measure(kind: str, args: argparse.Namespace, save) -> dict[str, Any]:
    """``args.pairs`` pairs of ``kind``, each judged as it finishes; ``save(tally)`` after every pair."""
    pairs: list[dict[str, Any]] = []
    apart: list[float] = []
    for index in range(1, args.pairs + 1):
        if args.interleaved:  # one run of twice the processes, its odd and even processes the two sides
            runs = [run(kind, args.runs_dir / f"{kind}-{index}-ab.json",
                        argparse.Namespace(**{**vars(args), "processes": 2 * args.processes}))]
            before, after = split_interleaved(json.loads(Path(runs[0]["path"]).read_text()))
        else:
            runs = [run(kind, args.runs_dir / f"{kind}-{index}-{side}.json", args) for side in ("a", "b")]
            before, after = (json.loads(Path(r["path"]).read_text()) for r in runs)
        apart += processes_apart(before) + processes_apart(after)
        slowed = scaled(after, args.scale)
        pair: dict[str, Any] = {"runs": runs}
        for suffix, pace in JUDGEMENTS.items():
            pair[f"same_code{suffix}"] = judged(before, after, args, pace)
            pair[f"planted{suffix}"] = judged(before, slowed, args, pace)
        pairs.append(pair)
        found = {side: [len(pair[side + suffix]["regressions"]) for suffix in JUDGEMENTS]
                 for side in ("same_code", "planted")}
        print(f"same_code_pairs: {kind} pair {index}: same code: {found['same_code'][0]} regression(s) "
              f"({found['same_code'][1]} as measured, {found['same_code'][2]} both ways), "
              f"{len(pair['same_code']['disturbed'])} disturbed; planted {args.scale}x: {found['planted'][0]} "
              f"regression(s) ({found['planted'][1]} as measured, {found['planted'][2]} both ways)", flush=True)
        save(tally(pairs, apart))
    return tally(pairs, apart)


def positive(kind: type, floor: float):
    """An argparse type: a ``kind`` above ``floor`` (integers: at least it), else a one-line error."""
    def parse(text: str):
        value = kind(text)
        if value < floor or (kind is float and value == floor):
            raise argparse.ArgumentTypeError(f"expected {'above' if kind is float else 'at least'} {floor:g}; "
                                             f"got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names a value it cannot convert by its type's name: "invalid int value"
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=positive(int, 1), help="pairs a kind (default 10; 1 with --quick)")
    parser.add_argument("--processes", type=positive(int, 1), help="per run and config (default: make perf's; "
                        "2 with --quick)")
    parser.add_argument("--iterations", type=positive(int, 1), help="per process (default: make perf's)")
    parser.add_argument("--warmup", type=positive(int, 0), help="warm-up calls a process and config (default: make "
                        "perf's; none with --quick)")
    parser.add_argument("--kinds", default="rollout,step", help="comma list of rollout, step")
    parser.add_argument("--scale", type=positive(float, 1.0), default=1.15, help="the planted slowdown (default "
                        "1.15)")
    parser.add_argument("--threshold", type=positive(float, 0.0), default=5.0, help="compare's, percent (default 5)")
    parser.add_argument("--model", help="the model (bench) or student (step); default: each kind's")
    parser.add_argument("--teacher", help="the step's teacher; default: the step's")
    parser.add_argument("--quick", action="store_true", help="a rehearsal on a tiny config (the tiny models, one "
                        "prompt of 8 tokens, 4 new, no warm-up): the whole path in a few minutes, no measurement")
    parser.add_argument("--interleaved", action="store_true", help="each pair one run of twice the processes, dealt "
                        "to the two sides as perf --against deals two revisions' (A B, B A, ...), not two runs one "
                        "after the other")
    parser.add_argument("--allow-disturbed", action="store_true", help="judge disturbed configs too (a rehearsal "
                        "on a busy machine; a measurement is made on a quiet one)")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "bench-results" / "variance")
    parser.add_argument("--output", type=Path, default=ROOT / "bench-results" / "variance" / "pairs.json")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or any(k not in KINDS for k in kinds):
        parser.error(f"--kinds: expected a comma list of {', '.join(KINDS)}; got {args.kinds!r}")
    if args.quick and (args.model or args.teacher):
        parser.error("--quick runs the tiny models; drop --model and --teacher")
    args.kinds = kinds
    quick = ({"pairs": 1, "processes": 2, "iterations": 2, "warmup": 0} if args.quick
             else {"pairs": 10, **perf_settings()})
    for name, default in quick.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def main(argv: list[str] | None = None) -> int:
    from opsd_rollout.files import write_json_atomic

    args = parse_args(argv)
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    command = " ".join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)])
    measured: dict[str, Any] = {}

    def save(kind: str, so_far: dict[str, Any]) -> None:
        write_json_atomic(args.output, {"settings": settings, "command": command,
                                        "minutes": (time.monotonic() - start) / 60, "load_now": os.getloadavg()[0],
                                        "kinds": {**measured, kind: so_far}})

    for kind in args.kinds:
        measured[kind] = measure(kind, args, lambda so_far, kind=kind: save(kind, so_far))
    for kind, m in measured.items():
        print(f"{kind}: same-code pairs with a regression: {m['same_code_pairs_with_a_regression']} of {args.pairs} "
              f"({m['same_code_pairs_with_a_regression_as_measured']} as measured); planted {args.scale}x flagged: "
              f"{m['planted_pairs_flagged']} of {args.pairs} ({m['planted_pairs_flagged_as_measured']} as measured); "
              f"flagged only where both judgements flag: {m['same_code_pairs_with_a_regression_both']} same-code, "
              f"{m['planted_pairs_flagged_both']} planted; "
              "pairs with a disturbed "
              f"config: {m['pairs_with_a_disturbed_config']}; two processes of one config apart by up to "
              f"{m['largest_ratio_of_two_processes']}")
    print(f"written: {args.output} ({(time.monotonic() - start) / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
