"""What the CPU weight layout (cpu_transposed_weights) costs and buys on this machine.

The model's linear layers multiplied at several row counts with the weights as the model keeps them
(``[out, in]``) and as ``[in, out]`` copies; the per-token decode time of whole rollouts both ways; and the
per-call copy (into copies already allocated).

    python scripts/weight_layout_cost.py                                   # llama-small, B = 1,4,8,16,32,64
    python scripts/weight_layout_cost.py --model qwen2-0.5b --batch-sizes 1,16,32 --rounds 3
    python scripts/weight_layout_cost.py --kernel-sweep                    # one weight per shape, 16 rows

Per-token decode time is the difference of two calls, ``max_new_tokens`` = SHORT and LONG (EOS ignored), over
LONG - SHORT: prefill, the per-call weight copy and other per-call work cancel. Both layouts interleaved,
medians; the tokens of the two are compared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from opsd_rollout.bench.argtypes import positive_int, positive_ints
from opsd_rollout.bench.report import write_text_atomic
from opsd_rollout.bench.workload import workload_rollout

SHORT, LONG = 8, 40


def matmuls(model, rows_list: list[int], repeats: int) -> list[dict]:
    """Per row count: ms of one pass over every eligible linear layer, model layout against ``[in, out]``."""
    import torch
    import torch.nn.functional as F

    from opsd_rollout.rollout.weight_layout import _eligible

    layers = [m for m in model.modules() if _eligible(m)]
    copies = [m.weight.detach().t().contiguous() for m in layers]
    out = []
    for rows in rows_list:
        inputs = [torch.randn(rows, 1, m.in_features) for m in layers]

        def model_layout():
            for m, x in zip(layers, inputs):
                F.linear(x, m.weight, m.bias)

        def transposed():
            for m, c, x in zip(layers, copies, inputs):
                F.linear(x, c.t(), m.bias)

        ms = {}
        for name, fn in (("model", model_layout), ("transposed", transposed)) * 2:  # second pass is kept
            fn()
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            ms[name] = (time.perf_counter() - start) / repeats * 1e3
        out.append({"rows": rows, "model_ms": ms["model"], "transposed_ms": ms["transposed"],
                    "speedup": ms["model"] / ms["transposed"]})
        print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    return out


def kernel_sweep(rows: int = 16, repeats: int = 30) -> list[dict]:
    """One random weight per (inputs K, outputs N), ``rows`` rows: median ms in the model layout and over an
    ``[in, out]`` copy, and the ratio (where oneMKL's slow path lies on this machine)."""
    import torch
    import torch.nn.functional as F

    out = []
    for k in (256, 512, 768, 896, 1024, 1536, 2048):
        for n in (512, 1408, 4096):
            weight = torch.randn(n, k)
            copy, x = weight.t().contiguous(), torch.randn(rows, 1, k)
            ms = {}
            for name, fn in (("model", lambda: F.linear(x, weight)), ("transposed", lambda: F.linear(x, copy.t()))):
                fn()
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    fn()
                    times.append((time.perf_counter() - start) * 1e3)
                ms[name] = statistics.median(times)
            out.append({"inputs": k, "outputs": n, "rows": rows, "model_ms": ms["model"],
                        "transposed_ms": ms["transposed"], "speedup": ms["model"] / ms["transposed"]})
            print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    return out


def copy_cost(model, repeats: int = 5) -> dict:
    """The per-call copy (``TransposedLinears.refresh``) into copies already allocated: median ms, and bytes."""
    from opsd_rollout.rollout.weight_layout import TransposedLinears

    linears = TransposedLinears()
    linears.refresh(model)  # allocates
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        linears.refresh(model)
        times.append((time.perf_counter() - start) * 1e3)
    return {"copy_ms": statistics.median(times), "bytes": linears.nbytes}


def per_token(model, tokenizer, args: argparse.Namespace) -> list[dict]:
    """Per batch size: ms per decode token with each layout (interleaved medians), and equal tokens. The copies
    are made whatever the model's size (a model over ``MAX_BYTES`` would otherwise compare its layout with itself);
    ``default_applies`` says whether a rollout would use them by default."""
    import torch

    from opsd_rollout import SamplingConfig
    from opsd_rollout.bench.prompts import synthetic_prompts
    from opsd_rollout.bench.timing import interleaved_times
    from opsd_rollout.rollout import weight_layout

    default_applies = sum(m.weight.nbytes for m in model.modules()
                          if weight_layout._eligible(m)) <= weight_layout.MAX_BYTES
    weight_layout.MAX_BYTES = float("inf")

    rollouts = {name: workload_rollout(model, tokenizer, "fixed", cpu_transposed_weights=name == "transposed",
                                       compile_decode=args.compile, seed=0)
                for name in ("model", "transposed")}
    rows = []
    for batch in args.batch_sizes:
        request = synthetic_prompts(batch, args.prompt_length, vocab_size=model.config.vocab_size, seed=batch)
        sampling = {r: SamplingConfig(max_new_tokens=r, temperature=0) for r in (SHORT, LONG)}
        tokens = {name: rollout.generate(request, sampling[LONG]).input_ids for name, rollout in rollouts.items()}
        calls = {f"{name} {r}": (lambda ro=rollout, r=r: ro.generate(request, sampling[r]))
                 for name, rollout in rollouts.items() for r in (SHORT, LONG)}
        times = interleaved_times(calls, args.rounds)
        ms = {name: (statistics.median(times[f"{name} {LONG}"]) - statistics.median(times[f"{name} {SHORT}"]))
              / (LONG - SHORT) for name in rollouts}
        profiled = workload_rollout(model, tokenizer, "fixed", enable_profiling=True, profile_forwards=False,
                                    cpu_transposed_weights=True)
        for _ in range(2):  # the second call's copy: into copies allocated by the first, as in a training loop
            profiled.generate(request, sampling[SHORT])
        profile = profiled.get_last_profile()
        rows.append({"batch_size": batch, "default_applies": default_applies, "model_ms_per_token": ms["model"],
                     "transposed_ms_per_token": ms["transposed"], "speedup": ms["model"] / ms["transposed"],
                     "equal_tokens": torch.equal(tokens["model"], tokens["transposed"]),
                     "weight_layout": profile.weight_layout, "weight_layout_ms": profile.weight_layout_ms,
                     "weight_layout_bytes": profile.weight_layout_bytes})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", default="llama-small", help="a preset name or a local checkpoint directory")
    parser.add_argument("--batch-sizes", type=positive_ints, default=[1, 4, 8, 16, 32, 64],
                        help="comma list of decode rows (default 1,4,8,16,32,64)")
    parser.add_argument("--prompt-length", type=positive_int, default=64)
    parser.add_argument("--rounds", type=positive_int, default=5, help="interleaved rounds, medians (default 5)")
    parser.add_argument("--repeats", type=positive_int, default=50, help="matmul passes timed per row count")
    parser.add_argument("--compile", action="store_true", help="both sides with compile_decode=True")
    parser.add_argument("--kernel-sweep", action="store_true",
                        help="only one weight per shape (inputs x outputs), 16 rows, both layouts")
    parser.add_argument("--output", help="write the figures as JSON here")
    args = parser.parse_args()
    import torch

    if args.kernel_sweep:
        write(args.output, {"threads": torch.get_num_threads(), "torch": torch.__version__,
                            "sweep": kernel_sweep()})
        return

    from opsd_rollout.models import load_model

    model, tokenizer = load_model(args.model)
    figures = {"model": args.model, "threads": torch.get_num_threads(), "torch": torch.__version__,
               "prompt_length": args.prompt_length, "rounds": args.rounds, "compile": args.compile,
               "matmuls": matmuls(model, args.batch_sizes, args.repeats), "copy": copy_cost(model),
               "per_token": per_token(model, tokenizer, args)}
    write(args.output, figures)


def write(path: str | None, figures: dict) -> None:
    """Print ``figures`` as JSON, and write them atomically to ``path`` if given."""
    text = json.dumps(figures, indent=2)
    if path:
        write_text_atomic(path, text)
    print(text)


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
