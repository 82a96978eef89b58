"""One-off reproducer of RESULTS.md "LoRA students" (issue 37, part 1), its merged-or-unmerged rollout table.

A LoRA student's rollout with its adapters merged into the weights for generation, against the adapters run
unmerged, on a DeepSpeed engine:

    python benchmarks/lora/lora_rollout.py                      # llama-tiny and llama-small, ZeRO 0 and 3
    python benchmarks/lora/lora_rollout.py --models llama-tiny --zero-stages 0 --iterations 10

The built-in run's rollout shape (8 prompts of 48 tokens, 32 sampled tokens, all-linear adapters of rank 8); the
two modes alternate call by call (ABAB...) after a warm-up of each, so load on the machine falls on both alike; the
figure is each mode's median ``total_ms``, and the merged mode's ``lora_fuse_ms + lora_unfuse_ms`` inside it.
"""

from __future__ import annotations

import argparse
import copy
import statistics


def measure(name: str, zero_stage: int, iterations: int, rank: int) -> dict[str, float]:
    import torch

    from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutRequest, SamplingConfig
    from opsd_rollout.deepspeed_engine import build_engine
    from opsd_rollout.models import load_model
    from opsd_rollout.train.lora import AdapterConfig, with_adapters

    model, tokenizer = load_model(name)
    student = with_adapters(model, AdapterConfig(rank=rank), name, seed=0)
    with torch.no_grad():  # trained adapters (B is zero at the start): a merge that changes the weights
        for param_name, param in student.named_parameters():
            if "lora_B" in param_name:
                param.normal_(0, 0.02)
    engine = build_engine(copy.deepcopy(student) if zero_stage == 3 else student, zero_stage, lr=1e-3)
    ids = torch.randint(3, 259, (8, 48))
    request = RolloutRequest(ids, torch.ones_like(ids))
    sampling = SamplingConfig(max_new_tokens=32, temperature=1.0, top_k=0)
    rollouts = {merge: HybridEngineRollout(engine, tokenizer, HybridEngineRolloutConfig(
        enable_profiling=True, merge_adapters=merge)) for merge in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    fuse: list[float] = []
    for i in range(iterations + 2):
        for merge, rollout in rollouts.items():
            rollout.generate(request, sampling, seed=i)
            profile = rollout.get_last_profile()
            if i >= 2:  # two warm-up calls each
                times[merge].append(profile.total_ms)
                if merge:
                    fuse.append(profile.lora_fuse_ms + profile.lora_unfuse_ms)
    return {"unmerged_ms": statistics.median(times[False]), "merged_ms": statistics.median(times[True]),
            "fuse_ms": statistics.median(fuse)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama-tiny,llama-small")
    parser.add_argument("--zero-stages", default="0,3")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    print("| student | ZeRO | unmerged ms | merged ms (of which merge + unmerge) | merged / unmerged |")
    print("|---|---:|---:|---:|---:|")
    for name in args.models.split(","):
        for stage in map(int, args.zero_stages.split(",")):
            r = measure(name, stage, args.iterations, args.rank)
            print(f"| {name} | {stage} | {r['unmerged_ms']:.1f} | {r['merged_ms']:.1f} ({r['fuse_ms']:.1f}) | "
                  f"{r['merged_ms'] / r['unmerged_ms']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
