"""What reading only the prompts still decoding buys in the shared-prefix layout: the long-tail workload with the
prefix part reading the store slots of prompts with a live row (the default) against every store slot at every
step (how it read before), both in one process, interleaved call by call, medians.

    python scripts/prefix_groups_cost.py                                  # greedy, and continuous_batch_size=16
    python scripts/prefix_groups_cost.py --decoding sampling --continuous 0,16 --rounds 5

The "every store slot" side patches ``SharedPrefix._bucket`` (how many store slots are read for a count in use)
to answer the store's size: the only change between the sides, so the same rows end at the same lengths and the
tokens are compared equal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

SHAPE = dict(prompts=16, samples=4, prompt_length=128, max_new_tokens=512)
LENGTHS = "lognormal:median=48,sigma=1.0"


def measure(args: argparse.Namespace) -> list[dict]:
    import torch

    from opsd_rollout import SamplingConfig
    from opsd_rollout.bench.prompts import synthetic_prompts
    from opsd_rollout.bench.timing import interleaved_times
    from opsd_rollout.bench.workload import workload_rollout
    from opsd_rollout.models import load_model
    from opsd_rollout.rollout import shared_prefix

    model, tokenizer = load_model(args.model, dtype="fp32", device=torch.device("cpu"))
    request = synthetic_prompts(SHAPE["prompts"], SHAPE["prompt_length"], vocab_size=model.config.vocab_size, seed=0)
    rollout = workload_rollout(model, tokenizer, LENGTHS, enable_profiling=False, seed=0)
    live_only = shared_prefix.SharedPrefix._bucket

    def every_slot(self, groups):  # noqa: ARG001 - the signature patched
        return self.store.slots

    rows = []
    for slots in args.continuous:
        sampling = SamplingConfig(max_new_tokens=SHAPE["max_new_tokens"], n_samples_per_prompt=SHAPE["samples"],
                                  temperature=1.0 if args.decoding == "sampling" else 0, top_k=50, top_p=0.95,
                                  continuous_batch_size=slots or None)
        tokens = {}

        def call(name, reads):
            def run():
                shared_prefix.SharedPrefix._bucket = reads
                try:
                    tokens[name] = rollout.generate(request, sampling).input_ids
                finally:
                    shared_prefix.SharedPrefix._bucket = live_only
            return run

        times = interleaved_times({"live prompts": call("live prompts", live_only),
                                   "every store slot": call("every store slot", every_slot)}, args.rounds)
        medians = {name: statistics.median(values) for name, values in times.items()}
        rows.append({"continuous_batch_size": slots or None, "decoding": args.decoding,
                     "live_prompts_ms": medians["live prompts"], "every_store_slot_ms": medians["every store slot"],
                     "speedup": medians["every store slot"] / medians["live prompts"],
                     "equal_tokens": torch.equal(tokens["live prompts"], tokens["every store slot"]),
                     "times_ms": times})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "times_ms"}), file=sys.stderr, flush=True)
    return rows


def positive_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = [-1]
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"a comma list of integers >= 0 (0: no continuous batching), got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--decoding", choices=("greedy", "sampling"), default="greedy")
    parser.add_argument("--continuous", type=positive_list, default=[0, 16],
                        help="continuous_batch_size values, 0 for none (default 0,16)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", help="write the rows as JSON here (atomically)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    rows = measure(args)
    print(f"{args.model}, B={SHAPE['prompts']} n={SHAPE['samples']} prompt {SHAPE['prompt_length']}, cap "
          f"{SHAPE['max_new_tokens']}, lengths {LENGTHS}, {args.decoding}, medians of {args.rounds} interleaved rounds")
    print("| continuous_batch_size | live prompts ms | every store slot ms | speed-up | equal tokens |")
    print("|---|---:|---:|---:|---|")
    for row in rows:
        print(f"| {row['continuous_batch_size'] or 'none'} | {row['live_prompts_ms']:,.0f} | "
              f"{row['every_store_slot_ms']:,.0f} | {row['speedup']:.2f}x | {row['equal_tokens']} |")
    if args.output:
        from opsd_rollout.bench.report import write_text_atomic

        write_text_atomic(args.output, json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
