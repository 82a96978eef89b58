"""What profiling costs: the same rollout with profiling on and off, interleaved, timed from outside.

    python scripts/profiling_overhead.py --model llama-small --rounds 10
"""

from __future__ import annotations

import argparse
import functools

import torch

from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, SamplingConfig
from opsd_rollout.bench.prompts import synthetic_prompts
from opsd_rollout.bench.stats import median
from opsd_rollout.bench.timing import interleaved_times
from opsd_rollout.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()

    model, tokenizer = load_model(args.model)
    request = synthetic_prompts(args.batch_size, args.prompt_length, vocab_size=model.config.vocab_size, seed=0)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, n_samples_per_prompt=args.samples_per_prompt,
                              temperature=0.0)
    rollouts = {
        "off": HybridEngineRollout(model, tokenizer),
        "on": HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(enable_profiling=True)),
    }
    times = interleaved_times({name: functools.partial(rollout.generate, request, sampling)
                               for name, rollout in rollouts.items()}, args.rounds)
    off, on = median(times["off"]), median(times["on"])
    print(f"{args.model}: B={args.batch_size} n={args.samples_per_prompt} prompt={args.prompt_length} "
          f"max_new_tokens={args.max_new_tokens}, greedy, threads {torch.get_num_threads()}, "
          f"median of {args.rounds} interleaved rounds")
    print("| profiling | median ms | min ms |")
    print("|---|---:|---:|")
    print(f"| off | {off:.1f} | {min(times['off']):.1f} |")
    print(f"| on | {on:.1f} | {min(times['on']):.1f} |")
    print(f"| overhead (median) | {100 * (on - off) / off:+.2f}% | |")


if __name__ == "__main__":
    main()
