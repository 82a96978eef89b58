"""A training step with a served teacher against the same teacher in process, runs alternating in one process:
``train`` on the built-in corpus (student ``llama-tiny``, teacher ``--teacher``, a top-k cache with the tail
bucket on both sides, so both train the same loss), the served one against our server on loopback (a thread of this
process, sharing its cores). Reports the median step time and teacher time of each side over every round.

    python scripts/served_step_time.py --rounds 2 --steps 8 --output benchmarks/serve/step-time.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

from opsd_rollout.files import write_text_atomic
from opsd_rollout.models import load_model
from opsd_rollout.serve import ServeConfig, TeacherServer
from opsd_rollout.train import TrainConfig, train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", default="llama-mini")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.teacher)
    server = TeacherServer(ServeConfig(model=args.teacher, port=0), model=model, tokenizer=tokenizer).start()
    common = dict(student="llama-tiny", teacher=args.teacher, steps=args.steps, eval_every=10**6, eval_prompts=1,
                  teacher_cache="topk", teacher_top_k=64, top_k_rest="tail", progress=False)
    times: dict[str, dict[str, list[float]]] = {}
    try:
        for round_ in range(args.rounds):
            for side in (("in-process", "served") if round_ % 2 == 0 else ("served", "in-process")):
                extra = {"teacher_url": server.url} if side == "served" else {}
                with tempfile.TemporaryDirectory() as out:
                    result = train(TrainConfig.from_flat({**common, **extra, "output_dir": out}))
                steps = [r for r in result.records if r["step"] > 1]  # the first step warms up
                seen = times.setdefault(side, {"step_ms": [], "teacher_ms": []})
                seen["step_ms"] += [r["time/step_ms"] for r in steps]
                seen["teacher_ms"] += [r["time/teacher_forward_ms"] + r.get("time/cache_write_ms", 0) for r in steps]
    finally:
        server.stop()
    summary = {side: {name: statistics.median(values) for name, values in seen.items()}
               for side, seen in times.items()}
    for side, figures in summary.items():
        print(f"{side}: step {figures['step_ms']:.0f} ms, teacher {figures['teacher_ms']:.0f} ms (medians)")
    ratio = summary["served"]["step_ms"] / summary["in-process"]["step_ms"]
    print(f"served / in-process step time: {ratio:.2f}")
    if args.output:
        write_text_atomic(Path(args.output), json.dumps({
            "command": " ".join(["python", "scripts/served_step_time.py", *(argv or sys.argv[1:])]),
            "machine": f"{platform.machine()}, {platform.python_version()}", "medians": summary,
            "served_over_in_process": ratio, "raw": times}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
