"""A one-off reproducer of benchmarks/RESULTS.md's "A self-teacher's memory" (issue 48): the peak memory of a training
step whose teacher is the student itself (its initial weights, its live ones) against a separate teacher of the same
size, for a full and a LoRA student; each arm a fresh `opsd-rollout train` process (the CPU's peak is the process's).

    python benchmarks/self-teacher/memory.py [--student qwen2-0.5b] [--output benchmarks/self-teacher/memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ARMS = {
    "separate teacher": ["--teacher", "{student}"],  # the same preset, other random weights
    "self, initial": ["--teacher", "self", "--self-teacher", "initial"],
    "self, live": ["--teacher", "self", "--self-teacher", "live"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--student", default="qwen2-0.5b")
    parser.add_argument("--output", default="benchmarks/self-teacher/memory.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "p.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"What is {i} plus {i}?", "reference": str(2 * i)}) + "\n"
                                for i in range(20)))
        for student in ("full", "lora"):
            for arm, flags in ARMS.items():
                out = Path(tmp) / f"{student}-{arm.replace(' ', '_').replace(',', '')}"
                command = [sys.executable, "-m", "opsd_rollout", "train", "--student", args.student,
                           *[f.format(student=args.student) for f in flags], "--prompts", str(data), "--steps", "2",
                           "--prompts-per-micro-batch", "2", "--max-new-tokens", "8", "--eval-every", "100",
                           "--eval-prompts", "1", "--output-dir", str(out), "--quiet",
                           *(["--lora-rank", "8"] if student == "lora" else [])]
                done = subprocess.run(command, capture_output=True, text=True, env={**os.environ})
                if done.returncode != 0:
                    print(done.stderr[-3000:], file=sys.stderr)
                    return 1
                records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
                last = records[-1]
                rows.append({"student": student, "teacher": arm, "peak_memory_bytes": last["peak_memory_bytes"],
                             "rss_bytes": last["rss_bytes"],
                             "command": [{str(data): "PROMPTS", str(out): "OUT"}.get(a, a) for a in command[1:]]})
                print(f"{student:5} {arm:17} peak {last['peak_memory_bytes'] / 2**30:6.2f} GiB, "
                      f"after the step {last['rss_bytes'] / 2**30:6.2f} GiB", flush=True)
    Path(args.output).write_text(json.dumps({"student": args.student, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
