"""Side by side on one DeepSpeed engine: our rollout (static strategy, and our generate strategy) against
DeepSpeed 0.19.8's HybridEngineRollout and transformers' plain generate, interleaved, medians of wall time.

    python scripts/compare_upstream.py                        # the default shapes, ZeRO-0, one process
    torchrun --nproc_per_node 2 scripts/compare_upstream.py --zero-stage 3 --shapes 2x1x128x16
    python scripts/compare_upstream.py --shapes 16x4x128x512 --lengths lognormal:median=48,sigma=1.0 \\
        --contenders static,static-no-compaction,deepspeed --continuous 16

``--lengths`` is the workload's response-length model, applied alike to every contender: ``fixed`` (the
default: EOS ignored, every row runs to the cap), ``natural`` (the model's own EOS) or a synthetic
distribution forced by the same per-row rule everywhere (``rollout/lengths.py``; a logits processor inside
DeepSpeed's and transformers' ``generate``). Greedy unless the shape says sampling. Besides the median time,
each contender's real tokens/s (response tokens up to each row's EOS, counted on the batches it returned, over all timed calls)
and its ratio to DeepSpeed's (a time ratio where the tokens are the same).
Only rank 0 prints.
"""

from __future__ import annotations

import argparse
import functools
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist
from deepspeed.runtime.rollout import HybridEngineRollout as DeepSpeedRollout
from transformers import LogitsProcessorList

from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutRequest, SamplingConfig
from opsd_rollout.bench.prompts import synthetic_prompts
import statistics

from opsd_rollout.bench.timing import interleaved_times
from opsd_rollout.deepspeed_engine import build_engine
from opsd_rollout.models import load_model
from opsd_rollout.bench.lengths import LengthModel
from opsd_rollout.bench.workload import LengthForcing, WorkloadRollout

CONTENDERS = ("static", "static-compiled", "static-no-compaction", "static-weight-copies", "static-copied-prompts",
              "static-no-shared-prefill", "static-whole-cache", "static-release", "per-layer-gather", "generate",
              "deepspeed", "transformers")
OPT_IN = ("static-compiled", "static-no-compaction", "static-weight-copies")
"""Contenders run only when named: the compiled step's first call compiles (tens of seconds on a CPU, in the
warm-up round), no compaction is the baseline of the long-tail comparison, and the model's own weight layout
the CPU weight copies are opt-in."""
LENGTH_SEED = 0
"""Our rollouts' seed: it forces the lengths (the processors use the same) and, sampling, draws the same random
numbers for a row of a call in every one of our contenders, so they sample the same tokens and do the same work
(up to the rounding of a layout that changes the logits' last bits)."""


def length_processors(lengths: LengthModel, sampling, eos: int, prompt_mask: torch.Tensor) -> dict:
    """``generate`` keyword arguments forcing ``lengths`` on the expanded prompts with ``prompt_mask``."""
    if not lengths.synthetic:
        return {}
    forcing = LengthForcing(lengths, sampling.max_new_tokens, eos, LENGTH_SEED)
    return {"logits_processor": LogitsProcessorList([forcing.as_logits_processor(prompt_mask,
                                                                                 sampling.n_samples_per_prompt)])}


class PlainGenerate:
    """transformers' generate on the expanded prompts, the baseline everyone has; stops at EOS unless the
    workload is ``fixed``."""

    def __init__(self, engine, tokenizer, lengths: LengthModel):
        self.model, self.pad, self.eos, self.lengths = engine.module, tokenizer.pad_token_id, tokenizer.eos_token_id, lengths

    def generate(self, request, sampling):
        n = sampling.n_samples_per_prompt
        ids = request.prompt_ids.repeat_interleave(n, 0)
        mask = request.prompt_attention_mask.repeat_interleave(n, 0)
        greedy = sampling.temperature <= 0
        extra = {} if greedy else dict(temperature=sampling.temperature, top_k=max(sampling.top_k, 0),
                                        top_p=sampling.top_p)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=sampling.max_new_tokens,
                                      do_sample=not greedy, pad_token_id=self.pad,
                                      eos_token_id=None if self.lengths.kind == "fixed" else self.eos,
                                      synced_gpus=dist.get_world_size() > 1,
                                      **length_processors(self.lengths, sampling, self.eos, mask), **extra)
        return SimpleNamespace(input_ids=out, response_start=ids.shape[1])


class ForcedDeepSpeed:
    """DeepSpeed's rollout with the workload's lengths forced inside the ``generate`` it calls (it always runs
    every row to ``max_new_tokens`` and pads after the first EOS, as its ZeRO-3 lockstep requires)."""

    def __init__(self, engine, tokenizer, lengths: LengthModel):
        self.inner, self.module, self.eos, self.lengths = DeepSpeedRollout(engine, tokenizer), engine.module, \
            tokenizer.eos_token_id, lengths

    def generate(self, request, sampling):
        if not self.lengths.synthetic:
            return self.inner.generate(request, sampling)
        original = self.module.generate

        def forced(input_ids, **kwargs):
            return original(input_ids, **kwargs, **length_processors(self.lengths, sampling, self.eos,
                                                                      kwargs["attention_mask"]))
        self.module.generate = forced
        try:
            return self.inner.generate(request, sampling)
        finally:
            del self.module.generate  # the instance attribute goes; the class's method shows again


class Chunked:
    """Our rollout called once per ``rows`` rows, one call after the other: what a trainer without continuous
    batching does with a batch too large for its memory."""

    def __init__(self, inner, rows: int):
        self.inner, self.rows = inner, rows

    def generate(self, request, sampling):
        prompts = max(1, self.rows // sampling.n_samples_per_prompt)
        return [self.inner.generate(RolloutRequest(request.prompt_ids[i:i + prompts],
                                                   request.prompt_attention_mask[i:i + prompts]), sampling)
                for i in range(0, request.prompt_ids.shape[0], prompts)]


class Continuous:
    """Our rollout with ``SamplingConfig.continuous_batch_size``."""

    def __init__(self, inner, slots: int):
        self.inner, self.slots = inner, slots

    def generate(self, request, sampling):
        return self.inner.generate(request, SamplingConfig(**{**vars(sampling), "continuous_batch_size": self.slots}))


def real_tokens(result, eos: int) -> int:
    """Response tokens up to and including each row's first EOS, whichever contender returned ``result``."""
    if isinstance(result, list):
        return sum(real_tokens(part, eos) for part in result)
    start = int(result.response_start_idx[0]) if hasattr(result, "response_start_idx") else result.response_start
    responses = result.input_ids[:, start:]
    ended = (responses == eos).long().cumsum(dim=1)
    return int(((ended == 0) | ((ended == 1) & (responses == eos))).sum())


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


def parse_lengths(text: str) -> LengthModel:
    try:
        return LengthModel.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def contenders_for(engine, tokenizer, args) -> dict:
    lengths = args.lengths
    def ours(**options):  # the workload's lengths forced by the bench's hook, the same seed everywhere
        rollout = HybridEngineRollout(engine, tokenizer, HybridEngineRolloutConfig.from_flat(
            enable_profiling=False, seed=LENGTH_SEED, **options))
        return WorkloadRollout(rollout, lengths, rollout.eos_token_ids, seed=LENGTH_SEED)

    def static(**options):
        return ours(strategy="static", **options)

    table = {
        "static": ("opsd static", lambda: static()),
        "static-compiled": ("opsd static, compiled step", lambda: static(compile_decode=True)),
        "static-no-compaction": ("opsd static, no row compaction", lambda: static(compact_rows=False)),
        "static-weight-copies": ("opsd static, the CPU weight copies (opt-in)",
                                 lambda: static(cpu_transposed_weights=True)),
        "static-copied-prompts": ("opsd static, prompt keys/values copied to every row",
                                  lambda: static(shared_prefix=False)),
        "static-no-shared-prefill": ("opsd static, no shared prefill", lambda: static(shared_prefill=False)),
        "static-whole-cache": ("opsd static, whole cache every step", lambda: whole_cache(static())),
        "static-release": ("opsd static, release workspace", lambda: static(cache_policy="release")),
        "per-layer-gather": ("opsd static, per-layer gather", lambda: static(zero3_gather="per_layer")),
        "generate": ("opsd generate", lambda: ours(strategy="generate")),
        "deepspeed": ("DeepSpeed HybridEngineRollout", lambda: ForcedDeepSpeed(engine, tokenizer, lengths)),
        "transformers": ("transformers generate", lambda: PlainGenerate(engine, tokenizer, lengths)),
    }
    assert tuple(table) == CONTENDERS
    chosen = {table[key][0]: table[key][1]() for key in args.contenders}
    if args.continuous:
        chosen[f"opsd static, continuous_batch_size={args.continuous}"] = Continuous(static(), args.continuous)
        chosen[f"opsd static, calls of {args.continuous} rows one after another"] = Chunked(static(), args.continuous)
    return chosen


def whole_cache(rollout: WorkloadRollout) -> WorkloadRollout:
    """Every decode step over the whole cache, masked, as the compiled step runs it (here eagerly)."""
    rollout.rollout.strategy.whole_cache = True
    return rollout


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--shapes", type=parse_shapes, default="4x1x128x32,2x8x512x32,4x4x128x32xsampling",
                        help="comma list of BxNxPxR[xsampling]")
    parser.add_argument("--lengths", type=parse_lengths, default="fixed",
                        help="response lengths: fixed (EOS ignored), natural, lognormal:median=M,sigma=S, "
                             "geometric:mean=M or uniform:low=L,high=H")
    parser.add_argument("--contenders", type=lambda text: text.split(","), default=None,
                        help=f"comma list of: {', '.join(CONTENDERS)} (per-layer-gather: ZeRO-3 only); default: "
                             f"all but {' and '.join(OPT_IN)} (and per-layer-gather below ZeRO-3)")
    parser.add_argument("--continuous", type=int, default=None, metavar="ROWS",
                        help="also run ours with continuous_batch_size=ROWS against calls of ROWS rows one after "
                             "another")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.contenders is None:
        args.contenders = [key for key in CONTENDERS if key not in OPT_IN
                           and (key != "per-layer-gather" or args.zero_stage == 3)]
    unknown = [key for key in args.contenders if key not in CONTENDERS]
    if unknown:
        parser.error(f"--contenders: unknown {unknown}; choose from {', '.join(CONTENDERS)}")
    if "per-layer-gather" in args.contenders and args.zero_stage != 3:
        parser.error("--contenders: per-layer-gather needs --zero-stage 3")
    if args.continuous is not None and args.continuous < 1:
        parser.error(f"--continuous must be at least 1, got {args.continuous}")

    model, tokenizer = load_model(args.model)
    engine = build_engine(model, args.zero_stage)
    main_rank = dist.get_rank() == 0
    contenders = contenders_for(engine, tokenizer, args)
    if main_rank:
        print(f"{args.model}, ZeRO-{args.zero_stage}, world size {dist.get_world_size()}, "
              f"{torch.get_num_threads()} threads, lengths {args.lengths.spec}, "
              f"median of {args.rounds} interleaved rounds (ms)")
    for shape in args.shapes:
        request = synthetic_prompts(shape.B, shape.P, vocab_size=model.config.vocab_size, seed=dist.get_rank())
        request = RolloutRequest(request.prompt_ids.to(engine.device), request.prompt_attention_mask.to(engine.device))
        sampling = SamplingConfig(max_new_tokens=shape.R, n_samples_per_prompt=shape.n,
                                  temperature=0.0 if shape.decoding == "greedy" else 1.0, top_k=50, top_p=0.95)
        tokens: dict[str, list[int]] = {name: [] for name in contenders}

        def timed(name, contender):
            tokens[name].append(real_tokens(contender.generate(request, sampling), tokenizer.eos_token_id))

        times = interleaved_times({name: functools.partial(timed, name, contender)
                                   for name, contender in contenders.items()}, args.rounds,
                                  device=engine.device, before_each=dist.barrier)
        medians = {name: statistics.median(values) for name, values in times.items()}
        # sampled rows' lengths vary call to call: throughput is over every timed call, not the last one
        counted = {name: tokens[name][-len(times[name]):] for name in times}
        rate = {name: sum(counted[name]) / sum(times[name]) * 1e3 for name in times}
        if main_rank:
            reference = next((name for name in medians if name.startswith("DeepSpeed")), next(iter(medians)))
            print(f"\n{shape.label}: B={shape.B} n={shape.n} prompt={shape.P} response={shape.R} {shape.decoding}, "
                  f"lengths {args.lengths.spec}")
            print(f"| rollout | median ms | real tokens per call | real tokens/s | vs {reference} |\n|---|---:|---:|---:|---:|")
            for name, value in medians.items():
                print(f"| {name} | {value:.1f} | {statistics.mean(counted[name]):.0f} | {rate[name]:.0f} | "
                      f"{rate[name] / rate[reference]:.2f}x |")

if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    main()
