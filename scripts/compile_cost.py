"""What compiling the decode step costs and buys on this machine: per-token decode time eager vs compiled at
several batch sizes (with their share of the measured copy bandwidth), the first call's compile time, and
what inductor's on-disk cache saves a second process.

    python scripts/compile_cost.py                               # llama-small, B = 1,4,16,32
    python scripts/compile_cost.py --batch-sizes 1,16 --rounds 7
    python scripts/compile_cost.py --cache-only                  # the two-process compile measurement only

Per-token decode time is the difference of two unprofiled calls, ``max_new_tokens`` = SHORT and LONG (EOS
ignored), over LONG - SHORT: prefill and per-call work cancel, hooks never break the compiled graph. Both
sides interleaved, medians. Utilisation = (weights + the KV cache read per step) / per-token time / the copy
bandwidth that ``opsd-rollout bench`` measures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from opsd_rollout.bench.report import write_text_atomic

SHORT, LONG = 8, 40


def per_token(args: argparse.Namespace, device: str = "cpu", dtype: str = "fp32") -> list[dict]:
    """Per batch size: eager and compiled ms per decode token, the speed-up, equal tokens, bandwidth shares."""
    import torch

    from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, SamplingConfig
    from opsd_rollout.bench.environment import measure_ceilings
    from opsd_rollout.bench.facts import decode_bytes_per_step
    from opsd_rollout.bench.prompts import synthetic_prompts
    from opsd_rollout.bench.timing import interleaved_times
    from opsd_rollout.bench.workload import WorkloadRollout
    from opsd_rollout.modeling import ModelSpec
    from opsd_rollout.models import load_model

    device = torch.device(device)
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    spec = ModelSpec.of(model)
    bandwidth = measure_ceilings(device)["memory_bandwidth_bytes_per_s"]
    rollouts = {name: WorkloadRollout(HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(
        compile_decode=name == "compiled", seed=0)), "fixed", ()) for name in ("eager", "compiled")}
    rows = []
    for batch in args.batch_sizes:
        request = synthetic_prompts(batch, args.prompt_length, vocab_size=model.config.vocab_size, seed=batch)
        request = type(request)(request.prompt_ids.to(device), request.prompt_attention_mask.to(device))
        tokens = {}
        for name, rollout in rollouts.items():  # compiles happen here, untimed; equal tokens checked
            start = time.perf_counter()
            tokens[name] = [rollout.generate(request, SamplingConfig(max_new_tokens=r, temperature=0)).input_ids
                            for r in (SHORT, LONG)]
            print(f"B={batch} {name}: first calls {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        equal = all(torch.equal(a, b) for a, b in zip(tokens["eager"], tokens["compiled"]))
        calls = {f"{name} {r}": (lambda ro=rollout, r=r: ro.generate(request, SamplingConfig(max_new_tokens=r,
                                                                                            temperature=0)))
                 for name, rollout in rollouts.items() for r in (SHORT, LONG)}
        times = interleaved_times(calls, args.rounds, device=device)
        ms = {name: (statistics.median(times[f"{name} {LONG}"]) - statistics.median(times[f"{name} {SHORT}"]))
              / (LONG - SHORT) for name in rollouts}
        read = decode_bytes_per_step(spec, batch, args.prompt_length + (SHORT + LONG) / 2)
        rows.append({"batch_size": batch, "eager_ms_per_token": ms["eager"], "compiled_ms_per_token": ms["compiled"],
                     "speedup": ms["eager"] / ms["compiled"], "equal_tokens": equal,
                     "eager_bandwidth_utilisation": read / (ms["eager"] / 1e3) / bandwidth,
                     "compiled_bandwidth_utilisation": read / (ms["compiled"] / 1e3) / bandwidth})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def first_call(args: argparse.Namespace) -> dict:
    """One process: the compiled rollout's first call (its compile_ms) and a second call's."""
    from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, SamplingConfig
    from opsd_rollout.bench.prompts import synthetic_prompts
    from opsd_rollout.bench.workload import WorkloadRollout
    from opsd_rollout.models import load_model

    model, tokenizer = load_model(args.model)
    rollout = WorkloadRollout(HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig.from_flat(
        compile_decode=True, enable_profiling=True, profile_forwards=False)), "fixed", ())
    request = synthetic_prompts(args.batch_sizes[0], args.prompt_length, vocab_size=model.config.vocab_size, seed=0)
    out = {}
    for call in ("first", "second"):
        start = time.perf_counter()
        rollout.generate(request, SamplingConfig(max_new_tokens=SHORT, temperature=0))
        profile = rollout.get_last_profile()
        out[call] = {"wall_ms": (time.perf_counter() - start) * 1e3, "compile_ms": profile.compile_ms,
                     "compiled_graphs": profile.compiled_graphs}
    return out


def cache_savings(args: argparse.Namespace) -> dict:
    """Two fresh processes sharing a new, empty inductor cache directory: cold, then warm."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        runs = []
        for _ in range(2):
            done = subprocess.run([sys.executable, __file__, "--first-call", "--model", args.model,
                                   "--batch-sizes", str(args.batch_sizes[0]), "--prompt-length",
                                   str(args.prompt_length)], env=env, capture_output=True, text=True, check=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {"cold_process": runs[0], "warm_cache_process": runs[1],
            "saved": 1 - runs[1]["first"]["compile_ms"] / runs[0]["first"]["compile_ms"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--batch-sizes", type=lambda text: [int(v) for v in text.split(",")], default=[1, 4, 16, 32])
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cache-only", action="store_true", help="only the two-process compile measurement")
    parser.add_argument("--first-call", action="store_true", help=argparse.SUPPRESS)  # one process of --cache-only
    parser.add_argument("--output", help="write the figures as JSON here")
    args = parser.parse_args()
    if min(args.batch_sizes) < 1 or args.rounds < 1 or args.prompt_length < 1:
        parser.error("--batch-sizes, --rounds and --prompt-length take positive integers")
    if args.first_call:
        print(json.dumps(first_call(args)))
        return
    import torch

    figures = {"model": args.model, "threads": torch.get_num_threads(), "torch": torch.__version__,
               "prompt_length": args.prompt_length, "rounds": args.rounds,
               "compile_cache": cache_savings(args)}
    print(json.dumps(figures["compile_cache"]), file=sys.stderr, flush=True)
    if not args.cache_only:
        figures["per_token"] = per_token(args)
    text = json.dumps(figures, indent=2)
    if args.output:
        write_text_atomic(args.output, text)
    print(text)


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
