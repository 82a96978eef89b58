"""One-off reproducer of load-llama-tiny.json and load-llama-small.json beside it (RESULTS.md, "A served teacher
under load", issue 35 part 7; ``tests/test_serve_load.py`` runs it with ``--check``).

Load on one teacher server: ``--clients`` concurrent clients (the ranks of a run) each send ``--requests``
requests to ``opsd-rollout serve-teacher`` (started here, in its own process, on loopback), every response checked
against the same teacher computed here; reports the latency percentiles, the throughput and the server's resident
memory over time (flat after warm-up, or this exits 1 with ``--check``).

    python benchmarks/serve/serve_load.py --model llama-small --clients 8 --requests 25 \\
        --output benchmarks/serve/load.json

Each request is ``--rows`` rows of ``--tokens`` tokens (random ids from a seed) with ``prompt_logprobs=--top-k``,
read with the served teacher's own client code (``opsd.served_wire``: every field checked); its given-token and
top-k log-probabilities must equal the local teacher's within ``--tolerance``. The first ``--warmup`` requests of
each client are the warm-up: memory is judged after them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import torch

from opsd_rollout.files import write_text_atomic
from opsd_rollout.models import load_model
from opsd_rollout.opsd.served_wire import Wire, read_response, request_body

MIB = 2**20


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """``serve-teacher`` in its own process; returns it and the URL it printed once ready."""
    command = [sys.executable, "-m", "opsd_rollout", "serve-teacher", "--model", args.model, "--port", "0",
               "--max-logprobs", str(args.top_k), "--max-batch-tokens", str(args.max_batch_tokens),
               "--max-queue", str(args.max_queue)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in server.stdout], daemon=True).start()
    deadline = time.monotonic() + args.start_timeout_s
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            if server.poll() is not None:
                break
            continue
        seen.append(line)
        if "serving teacher" in line:
            return server, line.split(" at ", 1)[1].split()[0]
    server.kill()
    raise RuntimeError("the server did not start:\n" + "".join(seen[-20:]))


class MemorySampler(threading.Thread):
    """The server's RSS every ``interval_s`` seconds, with the time since the start."""

    def __init__(self, pid: int, interval_s: float):
        super().__init__(daemon=True)
        self.process, self.interval_s = psutil.Process(pid), interval_s
        self.samples: list[tuple[float, int]] = []
        self.stopped = threading.Event()
        self.started_at = time.monotonic()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.samples.append((time.monotonic() - self.started_at, self.process.memory_info().rss))
            except psutil.Error:
                return
            self.stopped.wait(self.interval_s)


def make_requests(args: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    generator = torch.Generator().manual_seed(args.seed)
    return [torch.randint(3, vocab, (args.rows, args.tokens), generator=generator).tolist()
            for _ in range(args.distinct)]


def expected_answers(model: torch.nn.Module, requests: list[list[list[int]]], k: int):
    """Per request and row, from the local teacher: given-token log-probabilities [L - 1], top-k ids and values."""
    answers = []
    with torch.no_grad():
        for rows in requests:
            logp = torch.log_softmax(model(input_ids=torch.tensor(rows)).logits.float(), -1)[:, :-1]  # [B, L-1, V]
            given = logp.gather(-1, torch.tensor(rows)[:, 1:, None]).squeeze(-1)
            top = torch.topk(logp, k, dim=-1)
            answers.append((given, top.indices, top.values))
    return answers


def client(index: int, args: argparse.Namespace, url: str, requests, expected, marks: dict) -> list[dict]:
    wire = Wire(url, api_key=None, request_timeout_s=600, retry_timeout_s=120)
    records = []
    for number in range(args.requests):
        which = (index + number) % len(requests)
        rows = requests[which]
        path, body = request_body("vllm", args.model, rows, args.top_k)
        started = time.monotonic()
        status, answer = wire.post(path, body)
        latency = time.monotonic() - started
        positions = [list(range(1, len(row))) for row in rows]
        read = read_response("vllm", answer, rows, positions, args.top_k, vocab_size=None)
        given, ids, values = expected[which]
        wrong = []
        for row, got in enumerate(read):
            if not torch.allclose(got.token.float(), given[row], atol=args.tolerance, rtol=0):
                wrong.append(f"row {row}: given-token log-probabilities")
            if not torch.allclose(got.top_logprobs.float(), values[row], atol=args.tolerance, rtol=0):
                wrong.append(f"row {row}: top-k log-probabilities")
            if got.top_ids.ne(ids[row]).float().mean() > 0.01:  # a near-tie may swap two ids
                wrong.append(f"row {row}: top-k ids")
        records.append({"client": index, "request": number, "latency_s": latency, "status": status,
                        "correct": not wrong, "wrong": wrong, "end_s": time.monotonic() - marks["start"]})
        if number + 1 == args.warmup:
            marks.setdefault("warm", []).append(time.monotonic() - marks["start"])
    return records


def summarize(records: list[dict], samples: list[tuple[float, int]], warm_s: float, args) -> dict:
    latencies = np.array([r["latency_s"] for r in records if r["request"] >= args.warmup]) * 1e3
    after = [rss for t, rss in samples if t >= warm_s]
    quarter = max(1, len(after) // 4)
    first, last = float(np.median(after[:quarter])), float(np.median(after[-quarter:]))
    wall = max(r["end_s"] for r in records) - warm_s
    measured = len(latencies)
    return {
        "requests": len(records), "correct": sum(r["correct"] for r in records),
        "wrong": [f"client {r['client']} request {r['request']}: {w}" for r in records for w in r["wrong"]][:20],
        "latency_ms": {"p50": float(np.percentile(latencies, 50)), "p95": float(np.percentile(latencies, 95)),
                       "p99": float(np.percentile(latencies, 99)), "mean": float(latencies.mean()),
                       "max": float(latencies.max()), "count": measured},
        "throughput": {"requests_per_s": measured / wall, "tokens_per_s": measured * args.rows * args.tokens / wall},
        "server_rss_mib": {"at_ready": samples[0][1] / MIB, "after_warmup_first_quarter": first / MIB,
                           "last_quarter": last / MIB, "peak": max(rss for _, rss in samples) / MIB,
                           "growth_after_warmup": (last - first) / MIB,
                           "growth_after_warmup_pct": 100 * (last - first) / first},
        "rss_over_time": [(round(t, 2), round(rss / MIB, 1)) for t, rss in samples[::max(1, len(samples) // 60)]],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=25, help="per client, warm-up included")
    parser.add_argument("--warmup", type=int, default=3, help="first requests of each client not measured")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--distinct", type=int, default=8, help="distinct requests, cycled through")
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout-s", type=float, default=300)
    parser.add_argument("--output", help="JSON result file (written atomically)")
    parser.add_argument("--check", action="store_true", help="exit 1 unless every response is correct and the "
                        "server's RSS grows by at most --max-growth-mib after warm-up")
    parser.add_argument("--max-growth-mib", type=float, default=32.0)
    args = parser.parse_args(argv)
    model, _ = load_model(args.model)
    requests = make_requests(args, model.config.vocab_size)
    expected = expected_answers(model.eval(), requests, args.top_k)
    server, url = start_server(args)
    sampler = MemorySampler(server.pid, 0.25)
    sampler.start()
    marks = {"start": sampler.started_at}  # one clock: the samples' times and the requests' are from it
    load_before = os.getloadavg()
    try:
        with ThreadPoolExecutor(args.clients) as pool:
            results = list(pool.map(lambda i: client(i, args, url, requests, expected, marks), range(args.clients)))
    finally:
        sampler.stopped.set()
        sampler.join()
        server.terminate()
        server.wait(60)
    records = [r for rs in results for r in rs]
    warm_s = max(marks.get("warm", [0.0]))
    summary = summarize(records, sampler.samples, warm_s, args)
    given = argv if argv is not None else sys.argv[1:]
    document = {"command": "python benchmarks/serve/serve_load.py " + " ".join(given),
                "environment": {"python": platform.python_version(), "torch": torch.__version__,
                                "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                "torch_threads": torch.get_num_threads(),
                                "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]}},
                "config": {k: v for k, v in vars(args).items() if k not in ("output", "check")}, **summary}
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(args.output, json.dumps(document, indent=1) + "\n")
    lat, rss = summary["latency_ms"], summary["server_rss_mib"]
    print(f"{summary['correct']}/{summary['requests']} responses correct; latency ms p50 {lat['p50']:.1f} p95 "
          f"{lat['p95']:.1f} p99 {lat['p99']:.1f} (n={lat['count']}); {summary['throughput']['requests_per_s']:.2f} "
          f"req/s, {summary['throughput']['tokens_per_s']:.0f} tok/s; server RSS MiB ready {rss['at_ready']:.0f}, "
          f"after warm-up {rss['after_warmup_first_quarter']:.0f}, end {rss['last_quarter']:.0f}, peak "
          f"{rss['peak']:.0f} (growth after warm-up {rss['growth_after_warmup']:+.1f} MiB)")
    for line in summary["wrong"]:
        print("wrong:", line)
    if args.check and (summary["correct"] != summary["requests"] or rss["growth_after_warmup"] > args.max_growth_mib):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
