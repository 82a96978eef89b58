"""One-off reproducer of RESULTS.md "LoRA students" (issue 37, part 1), its built-in run table.

The built-in run's student trained with LoRA adapters against full fine-tuning:

    python benchmarks/lora/lora_builtin.py runs/lora                    # every variant below, one after another
    python benchmarks/lora/lora_builtin.py runs/lora --variants full,r8-lr3e-2

Each variant is the built-in run's distillation (``train.default.STUDENT``, the cached teacher; it is trained first
when absent, as ``opsd-rollout train`` does) with its changes; the table gives the trainable parameters, the peak
RSS (the process's, CPU), the median optimizer step and rollout after the first 10 steps, and the held-out reverse
KL at steps 0 and 200. A variant's run directory is kept: rerunning a finished variant reads its metrics back.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

VARIANTS = {
    "full": {},
    "r8": dict(lora_rank=8),
    "r8-lr3e-2": dict(lora_rank=8, lr=3e-2),
    "r32-lr3e-2": dict(lora_rank=32, lr=3e-2),
    "r8-lr3e-2-head": dict(lora_rank=8, lr=3e-2, lora_targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,"
                                                               "down_proj,lm_head,embed_tokens"),
    "r8-lr3e-2-unmerged": dict(lora_rank=8, lr=3e-2, merge_rollouts=False),
}
"""Name -> changes to the built-in run (``TrainConfig.from_flat``'s names; ``merge_rollouts`` the LoRA section's)."""


def run(name: str, out: Path) -> list[dict]:
    from opsd_rollout.train import TrainConfig, train
    from opsd_rollout.train.default import STUDENT, teacher_dir, trained_teacher

    directory = out / name
    metrics = directory / "metrics.jsonl"
    if not (directory / "model").is_dir():
        changes = dict(VARIANTS[name])
        merge_rollouts = changes.pop("merge_rollouts", True)
        trained_teacher(None, progress=False)
        config = TrainConfig.from_flat({**STUDENT, "output_dir": str(directory), "progress": False,
                                        "teacher": str(teacher_dir(None) / "model"), **changes})
        config = dataclasses.replace(config, lora=dataclasses.replace(config.lora, merge_rollouts=merge_rollouts))
        train(config)
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def summary(records: list[dict]) -> str:
    steps = [r for r in records if r["step"] > 10 and "time/step_ms" in r]
    kl = [(r["step"], r["eval_reverse_kl"]) for r in records if "eval_reverse_kl" in r]
    peak = max(r["peak_memory_bytes"] for r in records if "peak_memory_bytes" in r)
    return (f"{records[0]['trainable_parameters']:,} | {peak / 2**20:.0f} | "
            f"{statistics.median(r['time/step_ms'] for r in steps):.0f} | "
            f"{statistics.median(r['time/rollout_ms'] for r in steps):.0f} | {kl[0][1]:.3f} -> {kl[-1][1]:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    print("| variant | trainable | peak RSS MiB | step ms | rollout ms | held-out reverse KL, step 0 -> 200 |")
    print("|---|---:|---:|---:|---:|---|")
    for name in args.variants.split(","):
        print(f"| {name} | {summary(run(name, args.out))} |", flush=True)


if __name__ == "__main__":
    main()
