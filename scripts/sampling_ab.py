"""One step's CPU token selection from two versions of ``rollout/sampling.py``, side by side in one process:
64 rows, T=1, top-k 50, top-p 1.0 and 0.95, vocabularies 32,000 to 151,936; the same tokens asserted,
interleaved, medians of 15 calls (ms).

    git show REV:src/opsd_rollout/rollout/sampling.py > /tmp/sampling_before.py
    python scripts/sampling_ab.py /tmp/sampling_before.py src/opsd_rollout/rollout/sampling.py
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from types import SimpleNamespace

import torch


def load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("before", help="a sampling.py")
    parser.add_argument("after", help="another sampling.py")
    parser.add_argument("--rows", type=int, default=64)
    args = parser.parse_args()
    versions = {"before": load(args.before, "sampling_before"), "after": load(args.after, "sampling_after")}
    uniform = torch.rand(args.rows, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    print(f"{args.rows} rows, T=1, top-k 50, {torch.get_num_threads()} threads, median of 15 interleaved calls (ms)")
    print("| vocabulary | top-p | before | after | speed-up |\n|---:|---:|---:|---:|---:|")
    for vocab in (32000, 128256, 151936):
        logits = torch.randn(args.rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
        for top_p in (1.0, 0.95):
            plan = SimpleNamespace(greedy=False, temperature=1.0, top_k=50, top_p=top_p)
            picks = [module.sample(logits, plan, uniform) for module in versions.values()]
            assert torch.equal(*picks), "the two versions pick different tokens"
            times: dict[str, list[float]] = {name: [] for name in versions}
            for _ in range(15):
                for name, module in versions.items():
                    start = time.perf_counter()
                    module.sample(logits, plan, uniform)
                    times[name].append((time.perf_counter() - start) * 1e3)
            before, after = (statistics.median(times[name]) for name in versions)
            print(f"| {vocab:,} | {top_p} | {before:.1f} | {after:.1f} | {before / after:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
