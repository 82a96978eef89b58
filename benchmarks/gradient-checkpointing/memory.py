"""A one-off reproducer of benchmarks/RESULTS.md's "Gradient checkpointing's memory" (issue 47, part 7): the peak
memory of an OPSD training step with and without `--gradient-checkpointing`, for a full and a LoRA student, each arm a
fresh `opsd-rollout train` process (on the CPU the step's peak is the process's resident set, reset at the step's
start). The teacher is the student's live weights (`--teacher self --self-teacher live`: no second model), so the
difference is the student's activations.

    python benchmarks/gradient-checkpointing/memory.py [--student qwen2-0.5b] [--max-new-tokens 256]
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--student", default="qwen2-0.5b")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--prompts-per-micro-batch", type=int, default=4)
    parser.add_argument("--output", default="benchmarks/gradient-checkpointing/memory.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "p.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"What is {i} plus {i}?", "reference": str(2 * i)}) + "\n"
                                for i in range(20)))
        for student in ("full", "lora"):
            for checkpointing in (False, True):
                out = Path(tmp) / f"{student}-{checkpointing}"
                command = [sys.executable, "-m", "opsd_rollout", "train", "--student", args.student, "--teacher",
                           "self", "--self-teacher", "live", "--prompts", str(data), "--steps", "1",
                           "--prompts-per-micro-batch", str(args.prompts_per_micro_batch), "--max-new-tokens",
                           str(args.max_new_tokens), "--temperature", "1.0", "--eval-every", "100", "--eval-prompts",
                           "1", "--output-dir", str(out), "--quiet",
                           *(["--lora-rank", "8"] if student == "lora" else []),
                           *(["--gradient-checkpointing"] if checkpointing else [])]
                started = time.perf_counter()
                done = subprocess.run(command, capture_output=True, text=True, env={**os.environ})
                if done.returncode != 0:
                    print(done.stderr[-3000:], file=sys.stderr)
                    return 1
                step = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1]
                rows.append({"student": student, "gradient_checkpointing": checkpointing,
                             "peak_memory_bytes": step["peak_memory_bytes"], "response_tokens": step["response_tokens"],
                             "step_ms": step["time/step_ms"], "process_s": time.perf_counter() - started,
                             "load_after": os.getloadavg()[0],
                             "command": [{str(data): "PROMPTS", str(out): "OUT"}.get(a, a) for a in command[1:]]})
                print(f"{student:5} checkpointing {'on ' if checkpointing else 'off'} peak "
                      f"{step['peak_memory_bytes'] / 2**30:6.2f} GiB, {step['response_tokens']} response tokens, "
                      f"step {step['time/step_ms'] / 1e3:.0f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    Path(args.output).write_text(json.dumps({"student": args.student, "max_new_tokens": args.max_new_tokens,
                                             "prompts_per_micro_batch": args.prompts_per_micro_batch,
                                             "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
