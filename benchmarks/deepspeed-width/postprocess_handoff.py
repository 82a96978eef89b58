"""One-off reproducer of RESULTS.md's "inside a real rollout" figures of the post-processing hand-off (issue 38),
beside the kernel runs of the same section (postprocess-handoff-*.json).

Post-processing inside a real rollout of strategy ``static``, the decode loop's lengths handed over against the
EOS search they replace (the hand-off switched off for the other side), alternating calls in one process.

``llama-tiny`` (random weights), 1,024 rows = 256 prompts x 4 samples, prompt 512, up to 64 new tokens sampled at
T = 1 with geometric lengths (mean 32) ending at EOS (the bench's workload hook). Prints each side's median
``post_processing_ms`` over the calls after two warm-ups. Usage: ``python
benchmarks/deepspeed-width/postprocess_handoff.py [CALLS]``.
"""

from __future__ import annotations

import statistics
import sys

import torch

from opsd_rollout import RolloutRequest, SamplingConfig
from opsd_rollout.bench.workload import workload_rollout
from opsd_rollout.models import load_model
from opsd_rollout.rollout.decode.loop import DecodeLoop


def main(calls: int = 14) -> None:
    model, tokenizer = load_model("llama-tiny")
    rollout = workload_rollout(model, tokenizer, "geometric:mean=32", strategy="static", enable_profiling=True,
                               seed=1)
    prompts = torch.randint(5, 250, (256, 512), generator=torch.Generator().manual_seed(0))
    request = RolloutRequest(prompts, torch.ones_like(prompts))
    sampling = SamplingConfig(max_new_tokens=64, n_samples_per_prompt=4, temperature=1.0)
    run = DecodeLoop.run

    def searched(loop: DecodeLoop) -> torch.Tensor:
        tokens = run(loop)
        loop.stats.lengths = None  # post-processing then searches the tokens, as after strategy generate
        return tokens

    times: dict[str, list[float]] = {"handed over": [], "searched": []}
    try:
        for _ in range(calls):
            for side, loop_run in (("handed over", run), ("searched", searched)):
                DecodeLoop.run = loop_run
                rollout.generate(request, sampling)
                times[side].append(rollout.rollout.get_last_profile()["post_processing_ms"])
    finally:
        DecodeLoop.run = run
    for side, values in times.items():
        print(f"{side}: post_processing_ms median {statistics.median(values[2:]):.3f} over {len(values) - 2} calls")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 14)
