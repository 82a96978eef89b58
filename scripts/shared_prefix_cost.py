"""What shared-prefix attention buys: decode time per token and KV workspace bytes, each prompt's keys/values
stored once (``shared_prefix``) against a copy in every row's slot (``shared_prefix=False``), over prompt
lengths, both layouts interleaved call by call on one model, medians.

    python scripts/shared_prefix_cost.py                                  # llama-small, B=2, n=8, R=32
    python scripts/shared_prefix_cost.py --shape 2x2x32 --prompt-lengths 16,64,128,256 --rounds 7   # threshold

Greedy, fixed length (EOS ignored), profiling on: decode ms per token is the profile's ``decode_ms`` over its
``decode_steps`` (every forward that feeds one token per row), the workspace bytes its ``kv_workspace_bytes``
(each prompt length gets fresh rollouts, so the workspace is sized for that shape alone).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from opsd_rollout import HybridEngineRollout, SamplingConfig
from opsd_rollout.bench.argtypes import positive_int, positive_ints
from opsd_rollout.bench.prompts import synthetic_prompts
from opsd_rollout.bench.workload import workload_rollout
from opsd_rollout.bench.timing import interleaved_times
from opsd_rollout.models import load_model

LAYOUTS = {"copied": dict(shared_prefix=False), "shared": dict(shared_prefix=True, shared_prefix_min_prompt=1)}


def batch_shape(text: str) -> list[int]:
    """argparse type: ``BxNxR`` (prompts, samples per prompt, new tokens)."""
    values = positive_ints(text, "x")
    if len(values) != 3:
        raise argparse.ArgumentTypeError(f"a shape is BxNxR (prompts x samples x new tokens), got {text!r}")
    return values


def measure(model, tokenizer, batch: int, samples: int, prompt: int, response: int, rounds: int) -> dict:
    """Per layout: median decode ms per token, median call ms, KV workspace bytes, the layout that ran."""
    request = synthetic_prompts(batch, prompt, vocab_size=model.config.vocab_size, seed=prompt)
    sampling = SamplingConfig(max_new_tokens=response, n_samples_per_prompt=samples, temperature=0)
    profiles: dict[str, list] = {name: [] for name in LAYOUTS}

    def call(name: str, rollout: HybridEngineRollout) -> None:
        rollout.generate(request, sampling)
        profiles[name].append(rollout.get_last_profile())

    rollouts = {name: workload_rollout(model, tokenizer, "fixed", enable_profiling=True, **options)
                for name, options in LAYOUTS.items()}
    times = interleaved_times({name: (lambda name=name, r=r: call(name, r)) for name, r in rollouts.items()}, rounds)
    out = {}
    for name, recorded in profiles.items():
        measured = recorded[-rounds:]  # the warm-up round's profile is not a measurement
        out[name] = dict(decode=statistics.median(p.decode_ms / p.decode_steps for p in measured),
                         total=statistics.median(times[name]), kv=measured[-1].kv_workspace_bytes,
                         layout=measured[-1].kv_layout)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--shape", type=batch_shape, default="2x8x32", help="BxNxR: prompts, samples, new tokens")
    parser.add_argument("--prompt-lengths", type=positive_ints, default="128,1536", help="comma list")
    parser.add_argument("--rounds", type=positive_int, default=5, help="interleaved rounds per prompt length")
    args = parser.parse_args()
    (batch, samples, response), rounds = args.shape, args.rounds
    model, tokenizer = load_model(args.model)
    print(f"{args.model}, B={batch}, n={samples}, R={response}, greedy, {torch.get_num_threads()} threads, "
          f"median of {rounds} interleaved rounds")
    print("| prompt | decode ms/token copied | shared | speed-up | call ms copied | shared | KV MiB copied | shared "
          "| KV ratio |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = {}
    for prompt in args.prompt_lengths:
        result = measure(model, tokenizer, batch, samples, prompt, response, rounds)
        copied, shared = result["copied"], result["shared"]
        assert (copied["layout"], shared["layout"]) == ("copied", "shared_prefix"), result
        rows[prompt] = result
        print(f"| {prompt} | {copied['decode']:.2f} | {shared['decode']:.2f} | "
              f"{copied['decode'] / shared['decode']:.2f}x | {copied['total']:.1f} | {shared['total']:.1f} | "
              f"{copied['kv'] / 2**20:.1f} | {shared['kv'] / 2**20:.1f} | {copied['kv'] / shared['kv']:.2f}x |",
              flush=True)
    if len(rows) > 1:
        short, long = min(rows), max(rows)
        for name in LAYOUTS:
            print(f"{name}: decode per token at prompt {long} / at prompt {short}: "
                  f"{rows[long][name]['decode'] / rows[short][name]['decode']:.2f}x")


if __name__ == "__main__":
    main()
