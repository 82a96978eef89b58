"""One-off reproducer of issue 51, part 2: our rollout's lead over DeepSpeed's at 195f6ff and at this checkout.

Runs issue 51's seeded workloads, ``benchmarks/rollout-lead/workloads/`` (``shared-prefix.toml``: B=2 n=8, prompts 128, 512 and 1,536, 32
greedy tokens; ``long-tail.toml``: 24 rows, lognormal lengths up to 384, all at once and ``continuous_batch_size=8``)
as ``opsd-rollout bench --config FILE --strategies static,deepspeed --interleave``: ours and DeepSpeed 0.19.8's
``HybridEngineRollout`` on one ZeRO-0 engine, round by round in one process. Each commit runs in fresh processes (the
older one from a temporary git worktree, its own ``src`` on ``PYTHONPATH``), the two alternating (one order in odd
rounds, the other in even ones), so drift and neighbours hit both alike. Both commits read the same file: 195f6ff's
``bench`` has every key the files use (its CLI differs from today's only in flags they do not need).

Then, with each commit's iterations pooled over the rounds, the Hodges-Lehmann ratio and its 95% interval (``compare``'s
``bench/ratio_test.py``) of:
- the lead: DeepSpeed's ``total_ms`` over ours, per config of ours (5.04x is "5.04 times faster");
- decode per token (``tpot_ms``) at the longest prompt over the shortest, per contender, where a file has several;
- today over 195f6ff, per config (``total_ms``, and ``tpot_ms``): DeepSpeed's rollout is the same code at both
  commits, so its ratio says how much the machine moved between the sides.
It also checks that the work was the same: every iteration's generated tokens, per workload, equal across
contenders, rounds and commits (``same_work``).

Usage: ``python benchmarks/rollout-lead/measure.py [--rounds 3] [--iterations 6] [--output-dir DIR]``; ``--quick``
runs both files on ``llama-tiny`` at tiny shapes, one round, to check that the script works (its figures mean
nothing). Needs a quiet machine: it says how busy the machine was (load averages) before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ROOT / "benchmarks" / "rollout-lead" / "workloads"
OLD = "195f6ff"
CONTENDERS = ["--strategies", "static,deepspeed", "--interleave"]
QUICK = {
    "shared-prefix": ["--model", "llama-tiny", "--batch-sizes", "1", "--samples-per-prompt", "2", "--prompt-lengths",
                      "16,32", "--response-lengths", "8"],
    "long-tail": ["--model", "llama-tiny", "--batch-sizes", "1", "--samples-per-prompt", "4", "--prompt-lengths", "16",
                  "--response-lengths", "24", "--length-models", "lognormal:median=4,sigma=1.5",
                  "--continuous-batch-sizes", "none,2"],
}
"""``--quick``: each workload's flags over its file (flags override a config file), on the tiny model."""
SHAPE = ("batch_size", "samples_per_prompt", "prompt_length", "response_length", "dtype", "decoding", "zero_stage",
         "lengths")
"""A config's fields every contender shares: configs alike on these measure the same work."""


def label(config: dict) -> str:
    """``static P512`` or ``static P128 cbs=8``: what varies within the files, and the contender."""
    cbs = config.get("continuous_batch_size")
    return f"{config['strategy']} P{config['prompt_length']}" + (f" cbs={cbs}" if cbs else "")


def run_bench(source: Path, workload: str, out: Path, extra: list[str]) -> Path:
    """One fresh process of ``source``'s ``opsd-rollout bench`` on the workload's file; the result file."""
    command = [sys.executable, "-m", "opsd_rollout", "bench", "--config", str(WORKLOADS / f"{workload}.toml"),
               *CONTENDERS, *extra, "--output", str(out)]
    env = {**os.environ, "PYTHONPATH": str(source / "src")}
    started = time.monotonic()
    ran = subprocess.run(command, cwd=source, env=env, text=True, capture_output=True)
    if ran.returncode != 0:
        raise SystemExit(f"measure: {' '.join(command[1:])} in {source} failed (exit {ran.returncode}):\n"
                         f"{ran.stderr[-3000:]}")
    print(f"measure: {out.name}: {time.monotonic() - started:.0f} s", flush=True)
    return out


def pooled(files: list[Path]) -> dict[str, dict]:
    """Per config label: its config and every iteration of every file (rounds pooled); disturbed configs counted."""
    out: dict[str, dict] = {}
    for path in files:
        for result in json.loads(path.read_text())["results"]:
            if result["status"] != "ok":
                raise SystemExit(f"measure: {path.name}: {result['key']} is {result['status']}: {result.get('error')}")
            entry = out.setdefault(label(result["config"]), {"config": result["config"], "iterations": [],
                                                             "disturbed": 0})
            entry["iterations"] += result["iterations"]
            entry["disturbed"] += bool((result.get("interference") or {}).get("disturbed"))
    return out


def interval(before: list[float], after: list[float]) -> dict:
    """after / before: compare's Hodges-Lehmann ratio and 95% interval."""
    from opsd_rollout.bench.contenders import CONFIDENCE
    from opsd_rollout.bench.ratio_test import ratio_interval

    ratio, low, high = ratio_interval(before, after, CONFIDENCE)
    return {"ratio": ratio, "low": low, "high": high}


def values(entry: dict, metric: str) -> list[float]:
    return [it[metric] for it in entry["iterations"]]


def shape_of(entry: dict) -> tuple:
    return tuple(entry["config"].get(name) for name in SHAPE)


def figures(configs: dict[str, dict]) -> dict:
    """One commit's ratios: each of ours against DeepSpeed's on the same shape (the lead), and decode per token at
    the longest prompt over the shortest per contender and knobs."""
    deepspeed = {shape_of(e): e for e in configs.values() if e["config"]["strategy"] == "deepspeed"}
    lead = {name: interval(values(e, "total_ms"), values(deepspeed[shape_of(e)], "total_ms"))
            for name, e in configs.items() if e["config"]["strategy"] != "deepspeed" and shape_of(e) in deepspeed}
    decode = {}
    prompts = sorted({e["config"]["prompt_length"] for e in configs.values()})
    if len(prompts) > 1:
        for name, e in configs.items():
            if e["config"]["prompt_length"] == prompts[-1]:
                short = configs[name.replace(f"P{prompts[-1]}", f"P{prompts[0]}")]
                decode[f"{name} over P{prompts[0]}"] = interval(values(short, "tpot_ms"), values(e, "tpot_ms"))
    return {"lead": lead, "decode_per_token": decode}


def same_work(sides: dict[str, dict[str, dict]]) -> dict[str, list[int]]:
    """Per shape: the generated tokens of every iteration of every contender and commit, as a sorted set; one value
    where the work was the same."""
    tokens: dict[str, set[int]] = {}
    for configs in sides.values():
        for e in configs.values():
            c = e["config"]
            shape = f"B{c['batch_size']} n{c['samples_per_prompt']} P{c['prompt_length']} R{c['response_length']}"
            tokens.setdefault(shape, set()).update(int(it["generated_tokens"]) for it in e["iterations"])
    return {shape: sorted(found) for shape, found in tokens.items()}


def analyse(files: dict[str, list[Path]]) -> dict:
    sides = {commit: pooled(paths) for commit, paths in files.items()}
    old, new = sides[OLD], sides["today"]
    across = {}
    for name in sorted(set(old) & set(new)):
        across[name] = {"total_ms": interval(values(old[name], "total_ms"), values(new[name], "total_ms"))}
        if all(it.get("tpot_ms") for side in (old, new) for it in side[name]["iterations"]):
            across[name]["tpot_ms"] = interval(values(old[name], "tpot_ms"), values(new[name], "tpot_ms"))
    return {"commits": {commit: figures(configs) for commit, configs in sides.items()},
            "today_over_old": across, "same_work": same_work(sides),
            "iterations": {commit: {n: len(e["iterations"]) for n, e in configs.items()}
                           for commit, configs in sides.items()},
            "disturbed": {commit: {n: e["disturbed"] for n, e in configs.items() if e["disturbed"]}
                          for commit, configs in sides.items()}}


def text(figure: dict, suffix: str = "") -> str:
    return f"{figure['ratio']:.2f}{suffix} ({figure['low']:.2f}-{figure['high']:.2f})"


def report(workload: str, found: dict) -> None:
    print(f"\n{workload}  (Hodges-Lehmann ratios, 95% intervals; iterations per config: "
          f"{sorted(set(found['iterations']['today'].values()))})")
    for kind, title, suffix in (("lead", "DeepSpeed's time over ours", "x"),
                                ("decode_per_token", "tpot, longest prompt over shortest", "")):
        names = sorted({n for commit in found["commits"].values() for n in commit[kind]})
        for name in names:
            cells = [text(found["commits"][c][kind][name], suffix) if name in found["commits"][c][kind] else "-"
                     for c in (OLD, "today")]
            print(f"  {title + ': ' + name:<68} {OLD} {cells[0]:<22} today {cells[1]}")
    for name, ratios in found["today_over_old"].items():
        print(f"  {'today over ' + OLD + ': ' + name:<68} " + "  ".join(f"{m} {text(r)}" for m, r in ratios.items()))
    for shape, tokens in found["same_work"].items():
        print(f"  generated tokens, {shape}: {tokens}" + ("" if len(tokens) == 1 else "  NOT THE SAME WORK"))
    for commit, names in found["disturbed"].items():
        if names:
            print(f"  disturbed ({commit}): {names}")


def old_worktree(where: Path) -> Path:
    """A detached git worktree of ``OLD`` under ``where``."""
    path = where / OLD
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(path), OLD], check=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="shared-prefix,long-tail", help="files of benchmarks/rollout-lead/workloads/ (stems)")
    parser.add_argument("--rounds", type=int, default=3, help="processes per commit and workload (default 3)")
    parser.add_argument("--iterations", type=int, default=6, help="measured iterations per config and process")
    parser.add_argument("--quick", action="store_true", help="tiny shapes on llama-tiny, one round: a check")
    parser.add_argument("--output-dir", default=str(ROOT / "bench-results" / "rollout-lead"))
    args = parser.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    for workload in workloads:
        if not (WORKLOADS / f"{workload}.toml").is_file():
            parser.error(f"--workloads: no {workload}.toml in {WORKLOADS.relative_to(ROOT)}")
    if args.rounds < 1 or args.iterations < 2:
        parser.error(f"--rounds {args.rounds} --iterations {args.iterations}: need at least 1 and 2")
    rounds = 1 if args.quick else args.rounds
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    files: dict[str, dict[str, list[Path]]] = {w: {OLD: [], "today": []} for w in workloads}
    with tempfile.TemporaryDirectory(prefix="rollout-lead-") as scratch:
        old = old_worktree(Path(scratch))
        try:
            for round_ in range(rounds):
                order = [(OLD, old), ("today", ROOT)]
                for workload in workloads:
                    extra = (QUICK[workload] + ["--iterations", "4", "--warmup", "1"] if args.quick
                             else ["--iterations", str(args.iterations)])
                    for commit, source in order if round_ % 2 == 0 else order[::-1]:
                        path = out / f"{workload}-{commit}-{round_ + 1}.json"
                        files[workload][commit].append(run_bench(source, workload, path, extra))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    document = {"old": OLD, "today": _revision(), "rounds": rounds, "quick": args.quick,
                "load_average_before": load_before, "load_average_after": os.getloadavg(),
                "workloads": {w: analyse(files[w]) for w in workloads},
                "files": {w: {c: [p.name for p in paths] for c, paths in files[w].items()} for w in workloads}}
    from opsd_rollout.files import write_json_atomic

    write_json_atomic(out / "summary.json", document)
    for workload in workloads:
        report(workload, document["workloads"][workload])
    print(f"\nload average (1, 5, 15 min) before {load_before}, after {document['load_average_after']}; "
          f"everything in {out}")
    return 0


def _revision() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], text=True,
                          capture_output=True).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
