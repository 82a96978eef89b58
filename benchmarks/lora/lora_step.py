"""One-off reproducer of RESULTS.md "LoRA students" (issue 37, part 1), its OPSD step table.

The built-in run's OPSD step with a LoRA student against the whole student, alternating in one process:

    python benchmarks/lora/lora_step.py                           # llama-tiny from llama-mini, rank 8, 20 steps each
    python benchmarks/lora/lora_step.py --iterations 10 --ranks 8,32

The built-in run's shapes (8 prompts of the corpus, 32 sampled tokens, generalized JSD, ZeRO-0, AdamW at 3e-3), its
student and teacher presets (random weights: the time does not depend on them); the variants step in turn (ABAB...)
after two warm-up steps each, so the machine's load falls on all alike. The figure is each variant's median
``total_ms`` and ``rollout_ms`` (of which the LoRA merge, ``lora_fuse_ms + lora_unfuse_ms``), and the parameters
its optimizer holds. Also prints the trainable parameters of the realistic presets under the same adapters (counted
on the meta device, nothing trained).
"""

from __future__ import annotations

import argparse
import statistics


def variants(ranks: list[int]) -> dict[str, dict]:
    from opsd_rollout.train import TrainConfig
    from opsd_rollout.train.default import STUDENT

    configs = {"full": {}, **{f"lora r{r}": dict(lora_rank=r) for r in ranks},
               **{f"lora r{r} unmerged": dict(lora_rank=r) for r in ranks[:1]}}
    return {name: TrainConfig.from_flat({**STUDENT, "output_dir": "", "teacher": "llama-mini", "progress": False,
                                         **changes}) for name, changes in configs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--ranks", default="8")
    args = parser.parse_args()

    import dataclasses

    from opsd_rollout.models import model_skeleton
    from opsd_rollout.opsd.step import StepState, opsd_step
    from opsd_rollout.rollout import HybridEngineRollout
    from opsd_rollout.train.data import Encoder
    from opsd_rollout.train.lora import check_targets, trainable_parameters, with_adapters
    from opsd_rollout.train.setup import build_student_engine, load_models, split_examples

    runs = {}
    for name, config in variants([int(r) for r in args.ranks.split(",")]).items():
        models = load_models(config)
        engine = build_student_engine(config, models.student)
        merged = config.lora.enabled and not name.endswith("unmerged")
        rollout = HybridEngineRollout(engine, models.tokenizer, config.rollout.replace(merge_adapters=merged))
        runs[name] = (config, models, engine, rollout, StepState())
    config = next(iter(runs.values()))[0]
    examples, _ = split_examples(config, None)
    encoder = Encoder(next(iter(runs.values()))[1].tokenizer, max_prompt_tokens=512, max_reference_tokens=32)
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in runs}
    for i in range(args.iterations + 2):
        request = encoder.request(examples[8 * i:8 * i + 8], "cpu")
        for name, (config, models, engine, rollout, state) in runs.items():
            profile = opsd_step(engine, models.teacher, rollout, request, config.sampling,
                                divergence=config.divergence, teacher_cache=config.cache, state=state,
                                seed=i)
            fuse = sum(getattr(profile.rollout, f"lora_{part}_ms", None) or 0.0 for part in ("fuse", "unfuse"))
            if i >= 2:
                times[name].append((profile.total_ms, profile.rollout_ms, fuse))
    print("| student | trainable | step ms | rollout ms (of which merge + unmerge) |")
    print("|---|---:|---:|---:|")
    for name, rows in times.items():
        trainable, _ = trainable_parameters(runs[name][2].module)
        step, roll, fuse = (statistics.median(r[k] for r in rows) for k in range(3))
        print(f"| {name} | {trainable:,} | {step:.0f} | {roll:.0f} ({fuse:.1f}) |")
    print("\n| preset | parameters | LoRA r8 all-linear trainable |\n|---|---:|---:|")
    for preset in ("llama-small", "qwen2-0.5b", "llama-1b"):
        skeleton = model_skeleton(preset)
        adapters = dataclasses.replace(config.lora, rank=8)
        check_targets(skeleton, adapters, preset)
        trainable, total = trainable_parameters(with_adapters(skeleton, adapters, preset, seed=0))
        print(f"| {preset} | {total - trainable:,} | {trainable:,} |")


if __name__ == "__main__":
    main()
