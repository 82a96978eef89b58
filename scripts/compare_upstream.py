"""Side by side on one DeepSpeed engine: our rollout (static strategy, and our generate strategy) against
DeepSpeed 0.19.8's HybridEngineRollout and transformers' plain generate, interleaved, medians of wall time.

    python scripts/compare_upstream.py                        # the default shapes, ZeRO-0, one process
    torchrun --nproc_per_node 2 scripts/compare_upstream.py --zero-stage 3 --shapes 2x1x128x16

Every rollout runs fixed length (EOS ignored; DeepSpeed's always is), greedy unless the shape says
sampling, so the differences are the strategies' own. Only rank 0 prints.
"""

from __future__ import annotations

import argparse
import functools
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist
from deepspeed.runtime.rollout import HybridEngineRollout as DeepSpeedRollout

from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutRequest, SamplingConfig
from opsd_rollout.bench.prompts import synthetic_prompts
from opsd_rollout.bench.timing import interleaved_medians
from opsd_rollout.deepspeed_engine import build_engine
from opsd_rollout.models import load_model


class PlainGenerate:
    """transformers' generate on the expanded prompts, the baseline everyone has."""

    def __init__(self, engine, tokenizer):
        self.model, self.pad = engine.module, tokenizer.pad_token_id

    def generate(self, request, sampling):
        n = sampling.n_samples_per_prompt
        ids = request.prompt_ids.repeat_interleave(n, 0)
        mask = request.prompt_attention_mask.repeat_interleave(n, 0)
        greedy = sampling.temperature <= 0
        extra = {} if greedy else dict(temperature=sampling.temperature, top_k=max(sampling.top_k, 0),
                                        top_p=sampling.top_p)
        with torch.no_grad():
            return self.model.generate(ids, attention_mask=mask, max_new_tokens=sampling.max_new_tokens,
                                       do_sample=not greedy, eos_token_id=None, pad_token_id=self.pad,
                                       synced_gpus=dist.get_world_size() > 1, **extra)


def parse_shape(text: str) -> SimpleNamespace:
    """``BxNxPxR`` or ``BxNxPxRxsampling``."""
    parts = text.split("x")
    try:
        b, n, p, r = (int(v) for v in parts[:4])
    except ValueError:
        b = n = p = r = 0
    decoding = parts[4] if len(parts) == 5 else "greedy"
    if len(parts) not in (4, 5) or min(b, n, p, r) < 1 or decoding not in ("greedy", "sampling"):
        raise argparse.ArgumentTypeError(f"a shape is BxNxPxR[xsampling] with positive integers, got {text!r}")
    return SimpleNamespace(B=b, n=n, P=p, R=r, decoding=decoding, label=text)


def parse_shapes(text: str) -> list[SimpleNamespace]:
    return [parse_shape(part) for part in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--shapes", type=parse_shapes, default="4x1x128x32,2x8x512x32,4x4x128x32xsampling",
                        help="comma list of BxNxPxR[xsampling]")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")

    model, tokenizer = load_model(args.model)
    engine = build_engine(model, args.zero_stage)
    main_rank = dist.get_rank() == 0
    fixed = dict(enable_profiling=False, ignore_eos=True)
    contenders = {
        "opsd static": HybridEngineRollout(engine, tokenizer, HybridEngineRolloutConfig(strategy="static", **fixed)),
        "opsd static, no shared prefill": HybridEngineRollout(engine, tokenizer, HybridEngineRolloutConfig(
            strategy="static", shared_prefill=False, **fixed)),
        "opsd static, whole cache every step": HybridEngineRollout(engine, tokenizer, HybridEngineRolloutConfig(
            strategy="static", static_shapes=True, **fixed)),
        "opsd static, release workspace": HybridEngineRollout(engine, tokenizer, HybridEngineRolloutConfig(
            strategy="static", cache_policy="release", **fixed)),
        "opsd generate": HybridEngineRollout(engine, tokenizer, HybridEngineRolloutConfig(strategy="generate",
                                                                                          **fixed)),
        "DeepSpeed HybridEngineRollout": DeepSpeedRollout(engine, tokenizer),
        "transformers generate": PlainGenerate(engine, tokenizer),
    }
    if args.zero_stage == 3:
        contenders["opsd static, per-layer gather"] = HybridEngineRollout(engine, tokenizer, HybridEngineRolloutConfig(
            strategy="static", zero3_gather="per_layer", **fixed))
    if main_rank:
        print(f"{args.model}, ZeRO-{args.zero_stage}, world size {dist.get_world_size()}, "
              f"{torch.get_num_threads()} threads, median of {args.rounds} interleaved rounds (ms)")
    for shape in args.shapes:
        request = synthetic_prompts(shape.B, shape.P, vocab_size=model.config.vocab_size, seed=dist.get_rank())
        request = RolloutRequest(request.prompt_ids.to(engine.device), request.prompt_attention_mask.to(engine.device))
        sampling = SamplingConfig(max_new_tokens=shape.R, n_samples_per_prompt=shape.n,
                                  temperature=0.0 if shape.decoding == "greedy" else 1.0, top_k=50, top_p=0.95)
        medians = interleaved_medians({name: functools.partial(contender.generate, request, sampling)
                                       for name, contender in contenders.items()}, args.rounds,
                                      device=engine.device, before_each=dist.barrier)
        if main_rank:
            reference = medians["DeepSpeed HybridEngineRollout"]
            print(f"\n{shape.label}: B={shape.B} n={shape.n} prompt={shape.P} response={shape.R} {shape.decoding}")
            print("| rollout | median ms | speed-up vs DeepSpeed |\n|---|---:|---:|")
            for name, value in medians.items():
                print(f"| {name} | {value:.1f} | {reference / value:.2f}x |")


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    main()
