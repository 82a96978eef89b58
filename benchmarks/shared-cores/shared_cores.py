"""One-off reproducer of RESULTS.md "Sharing the cores" (issue 36, part 1).

The built-in teacher's SFT step alone and beside another 2-thread torch process, with OpenMP's active and passive
waits:

    python benchmarks/shared-cores/shared_cores.py   # four runs: {alone, beside a matmul loop} x {active, passive}

Each run is a fresh process (OpenMP reads OMP_WAIT_POLICY once): ``train`` on the built-in teacher's recipe for 14
steps, the median step time of steps 4-14. ``--step`` runs one measurement in this process; ``--burn`` is the other
process (a 512x512 matmul loop on 2 threads).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time


def step() -> None:
    from dataclasses import replace

    from opsd_rollout.train import train
    from opsd_rollout.train.default import TEACHER

    with tempfile.TemporaryDirectory() as out:
        result = train(replace(TEACHER, output_dir=out, steps=14, eval_every=10**6, eval_prompts=1, save_every=None,
                               progress=False))
    print(f"{statistics.median(r['time/step_ms'] for r in result.records if r['step'] > 3):.0f}")


def burn() -> None:
    import torch

    torch.set_num_threads(2)
    a, end = torch.randn(512, 512), time.time() + 900
    while time.time() < end:
        a @ a


def measure(policy: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    done = subprocess.run([sys.executable, __file__, "--step"], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def main() -> int:
    if sys.argv[1:] == ["--step"]:
        step()
        return 0
    if sys.argv[1:] == ["--burn"]:
        burn()
        return 0
    for beside in (False, True):
        other = subprocess.Popen([sys.executable, __file__, "--burn"]) if beside else None
        try:
            time.sleep(2 if beside else 0)
            for policy in (None, "PASSIVE"):
                print(f"{'beside' if beside else 'alone':6s} {policy or 'active':7s} {measure(policy)} ms", flush=True)
        finally:
            if other is not None:
                other.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
