"""One-off reproducer of agreement.json beside it (RESULTS.md, "Faults", issue 50 part 2).

What the ranks' agreement costs a training step: ``train`` calls ``faults.Agreement.check`` once a micro-batch,
one all-reduce of two host integers (``distributed.agree_max`` on gloo), and with it the non-finite guard reads one
number per optimizer step. This times both on 2 CPU ranks (gloo, loopback; started here), beside a training step's
own time when given a 2-rank run's ``metrics.jsonl``:

    python benchmarks/faults/agreement_cost.py --calls 2000 --metrics runs/two-ranks/metrics.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from opsd_rollout.distributed import agree_max, free_port


def rank_main(rank: int, port: int, calls: int, warmup: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    times = []
    for call in range(warmup + calls):
        started = time.perf_counter()
        agree_max([0, int(call == -1)])
        if call >= warmup:
            times.append((time.perf_counter() - started) * 1e6)
    norm = torch.tensor(0.5)
    reads = []
    for _ in range(calls):
        started = time.perf_counter()
        bool(torch.isfinite(norm))  # the guard's one read at an optimizer step (ZeRO-0, float32)
        reads.append((time.perf_counter() - started) * 1e6)
    if rank == 0:
        with open(out, "w") as handle:
            json.dump({"agreement_us": times, "guard_read_us": reads}, handle)
    dist.destroy_process_group()


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p95": ordered[int(0.95 * (len(ordered) - 1))],
            "count": len(ordered)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--metrics", help="a 2-rank run's metrics.jsonl: its median time/step_ms, for the share")
    parser.add_argument("--output", help="JSON result file")
    args = parser.parse_args(argv)
    handle, out = tempfile.mkstemp(suffix=".json")
    os.close(handle)
    load_before = os.getloadavg()[0]
    mp.spawn(rank_main, args=(free_port(), args.calls, args.warmup, out), nprocs=2, join=True)
    with open(out) as handle:
        raw = json.load(handle)
    os.unlink(out)
    result = {"agreement_us": summary(raw["agreement_us"]), "guard_read_us": summary(raw["guard_read_us"]),
              "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]}}
    if args.metrics:
        with open(args.metrics) as handle:
            steps = [json.loads(line) for line in handle if line.strip()]
        step_ms = statistics.median(r["time/step_ms"] for r in steps if "time/step_ms" in r)
        micro = statistics.median(r["micro_batches"] for r in steps if "micro_batches" in r)
        result["step_ms_median"] = step_ms
        result["agreement_share_of_step"] = micro * result["agreement_us"]["median"] / 1e3 / step_ms
    print(json.dumps(result, indent=1))
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"command": "python benchmarks/faults/agreement_cost.py " + " ".join(sys.argv[1:]), **result}, handle,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
