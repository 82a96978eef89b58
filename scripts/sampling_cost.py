"""What sampling costs, in two tables:

1. sampling against greedy with our static strategy: one rollout object, the two decodings interleaved
   call by call, medians of wall time (no host sync per step, so sampling should cost a few percent);
2. one step's token selection for 16 rows at real vocabulary sizes: ours (top-k candidates on CPU,
   inverse-CDF draw) against transformers' warpers + ``multinomial``, what ``generate`` does.

    python scripts/sampling_cost.py          # llama-small, B=4, n=1 and 4, prompt 128, 32 tokens; vocab 259..151,936
"""

from __future__ import annotations

import argparse
import functools
from types import SimpleNamespace

import torch

from opsd_rollout import SamplingConfig
from opsd_rollout.bench.argtypes import positive_int, positive_ints
from opsd_rollout.bench.prompts import synthetic_prompts
from opsd_rollout.bench.workload import workload_rollout
from opsd_rollout.bench.timing import interleaved_medians
from opsd_rollout.models import load_model
from opsd_rollout.rollout.sampling import sample


def transformers_sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                        generator: torch.Generator) -> torch.Tensor:
    """What ``generate(do_sample=True)`` does at each step: the warpers, softmax, ``multinomial``."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    scores = TemperatureLogitsWarper(temperature)(None, logits)
    scores = TopPLogitsWarper(top_p)(None, TopKLogitsWarper(top_k)(None, scores))
    return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(1)


def selection_table(vocab_sizes: list[int], rows: int, rounds: int) -> None:
    print(f"\nOne step's token selection, {rows} rows, T=1, top-k 50, top-p 0.95, median of {rounds} (ms)")
    print("| vocabulary | logits | transformers warpers + multinomial | ours | speed-up |\n|---:|---|---:|---:|---:|")
    plan = SimpleNamespace(greedy=False, temperature=1.0, top_k=50, top_p=0.95)
    generator = torch.Generator().manual_seed(0)
    for vocab in vocab_sizes:
        for dtype in (torch.float32, torch.bfloat16):  # bf16 logits tie often at the k-th
            logits = (torch.randn(rows, vocab, generator=generator) * 3).to(dtype)
            medians = interleaved_medians(
                {"transformers": lambda: transformers_sample(logits.float(), 1.0, 50, 0.95, generator),
                 "ours": lambda: sample(logits, plan, generator)}, rounds)
            theirs, ours = medians["transformers"], medians["ours"]
            print(f"| {vocab:,} | {str(dtype).removeprefix('torch.')} | {theirs:.3f} | {ours:.3f} | "
                  f"{theirs / ours:.1f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--batch-size", type=positive_int, default=4)
    parser.add_argument("--samples-per-prompt", type=positive_ints, default=[1, 4], help="comma list")
    parser.add_argument("--prompt-length", type=positive_int, default=128)
    parser.add_argument("--max-new-tokens", type=positive_int, default=32)
    parser.add_argument("--rounds", type=positive_int, default=11)
    parser.add_argument("--vocab-sizes", type=positive_ints, default=[259, 32000, 151936],
                        help="comma list for the second table")
    args = parser.parse_args()

    model, tokenizer = load_model(args.model)
    rollout = workload_rollout(model, tokenizer, "fixed", strategy="static")
    request = synthetic_prompts(args.batch_size, args.prompt_length, vocab_size=model.config.vocab_size, seed=0)
    print(f"{args.model}, B={args.batch_size}, prompt {args.prompt_length}, {args.max_new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads, median of {args.rounds} interleaved rounds (ms)")
    print("| n | greedy | sampling (T=1, top-k 50, top-p 0.95) | sampling vs greedy |\n|---:|---:|---:|---:|")
    for n in args.samples_per_prompt:
        decodings = {
            "greedy": SamplingConfig(max_new_tokens=args.max_new_tokens, n_samples_per_prompt=n, temperature=0.0),
            "sampling": SamplingConfig(max_new_tokens=args.max_new_tokens, n_samples_per_prompt=n, temperature=1.0,
                                       top_k=50, top_p=0.95),
        }
        medians = interleaved_medians(
            {name: functools.partial(rollout.generate, request, config) for name, config in decodings.items()},
            args.rounds)
        greedy, sampled = medians["greedy"], medians["sampling"]
        print(f"| {n} | {greedy:.1f} | {sampled:.1f} | {(sampled / greedy - 1) * 100:+.1f}% |")
    selection_table(args.vocab_sizes, rows=16, rounds=args.rounds)


if __name__ == "__main__":
    main()
