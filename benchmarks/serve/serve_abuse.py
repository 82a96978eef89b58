"""One-off reproducer of abuse.json beside it (RESULTS.md, "Faults", issue 50 part 6; ``tests/test_serve_abuse.py``
runs it with ``--check``).

The teacher server under abuse: ``--requests`` bounded requests (10,000 by default) against ``opsd-rollout
serve-teacher`` in its own process on loopback, a mix of faults (``FAULTS``: bodies too large by their length or
in chunks, malformed JSON, a wrong key, prompts over a limit, bursts over the queue, bodies and heads that never
finish), each of which must get its status (or its connection closed); good requests, sent meanwhile with the
served teacher's own client (which retries a 429 or 503 as a run does), must all be answered; the server's resident
memory is read before the abuse (after a warm-up) and after each of ``--rounds`` rounds of it (a second round that
adds nothing says the first's rise was the allocator's high water, not a leak).

    python benchmarks/serve/serve_abuse.py --rounds 2 --output benchmarks/serve/abuse.json --check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from serve_load import MIB, MemorySampler, start_server

from opsd_rollout.files import write_text_atomic
from opsd_rollout.opsd.served_wire import Wire, read_response, request_body

KEY = "sk-abuse"
GOOD_ROWS = [[5, 6, 7, 8, 9, 10, 11, 12]]
FAULTS = {  # name: (share of the requests, what each must get, whether it waits --read-timeout)
    "body too large, by its Content-Length": (0.15, {413}, False),
    "body too large, in chunks without a length": (0.15, {413}, False),
    "malformed JSON": (0.20, {400}, False),
    "wrong key": (0.20, {401}, False),
    "prompt over --max-model-len": (0.05, {400}, False),
    "too many at once (bursts of 4 x --max-queue)": (0.20, {200, 429, 503}, False),
    "body that never finishes": (0.03, {408}, True),
    "head that never finishes": (0.02, {"closed"}, True),
}


def head(path: str, key: str | None, **headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: teacher", "Content-Type: application/json",
             *([f"Authorization: Bearer {key}"] if key else []),
             *(f"{name.replace('_', '-')}: {value}" for name, value in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def exchange(url: str, parts: list[bytes], timeout_s: float) -> int | str:
    """Send ``parts`` on a fresh connection and read the answer's status: an int, ``closed`` when the server closed
    without one, or ``error: ...``."""
    host, port = url.removeprefix("http://").split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            for part in parts:
                try:
                    sock.sendall(part)
                except (BrokenPipeError, ConnectionResetError):
                    break  # answered and closed before the rest: read the answer
            data = b""
            while b"\r\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    return "closed" if not data else f"error: {data[:80]!r}"
                data += chunk
            return int(data.split()[1])
    except OSError as error:
        return f"error: {type(error).__name__}: {error}"


def fault_request(name: str, url: str, args: argparse.Namespace) -> int | str:
    good = json.dumps({"model": "teacher", "prompt": GOOD_ROWS, "prompt_logprobs": 2}).encode()
    wait = args.read_timeout + 30
    if name.startswith("body too large, by"):
        return exchange(url, [head("/v1/completions", KEY, Content_Length="1000000000")], wait)
    if name.startswith("body too large, in chunks"):
        chunk = b"4000\r\n" + b"1" * 0x4000 + b"\r\n"  # 16 KiB a chunk, past the limit by the fifth
        return exchange(url, [head("/v1/completions", KEY, Transfer_Encoding="chunked"), *[chunk] * 6], wait)
    if name == "malformed JSON":
        body = good[:-7]
        return exchange(url, [head("/v1/completions", KEY, Content_Length=str(len(body))), body], wait)
    if name == "wrong key":
        return exchange(url, [head("/v1/completions", "sk-wrong", Content_Length=str(len(good))), good], wait)
    if name.startswith("prompt over"):
        body = json.dumps({"prompt": [[5] * (args.max_model_len + 1)], "prompt_logprobs": 2}).encode()
        return exchange(url, [head("/v1/completions", KEY, Content_Length=str(len(body))), body], wait)
    if name == "body that never finishes":
        return exchange(url, [head("/v1/completions", KEY, Content_Length=str(len(good))), good[:10]], wait)
    if name == "head that never finishes":
        return exchange(url, [b"POST /v1/completions HTTP/1.1\r\nHost: teacher\r\nContent-Le"], wait)
    raise ValueError(name)


def burst(url: str, size: int, args: argparse.Namespace) -> list[int | str]:
    """``size`` good requests at once, none retried."""
    good = json.dumps({"model": "teacher", "prompt": GOOD_ROWS, "prompt_logprobs": 2}).encode()
    parts = [head("/v1/completions", KEY, Content_Length=str(len(good))), good]
    with ThreadPoolExecutor(size) as pool:
        return list(pool.map(lambda _: exchange(url, parts, args.read_timeout + 30), range(size)))


def run_faults(url: str, args: argparse.Namespace) -> dict[str, dict]:
    """Every fault, its share of ``--requests``; the quick ones ``--concurrency`` at once, the ones that wait for
    the read timeout ``--slow-concurrency`` at once, bursts one after another."""
    counts = {name: round(share * args.requests) for name, (share, _, _) in FAULTS.items()}
    outcomes: dict[str, list] = {name: [] for name in FAULTS}
    quick = [name for name, (_, _, slow) in FAULTS.items() if not slow and not name.startswith("too many")]
    slow = [name for name, (_, _, waits) in FAULTS.items() if waits]
    bursts = next(name for name in FAULTS if name.startswith("too many"))

    def each(names: list[str], concurrency: int) -> None:
        jobs = [name for name in names for _ in range(counts[name])]
        with ThreadPoolExecutor(concurrency) as pool:
            for name, outcome in zip(jobs, pool.map(lambda name: fault_request(name, url, args), jobs)):
                outcomes[name].append(outcome)

    threads = [threading.Thread(target=each, args=(quick, args.concurrency)),
               threading.Thread(target=each, args=(slow, args.slow_concurrency))]
    for thread in threads:
        thread.start()
    size = 4 * args.max_queue
    while len(outcomes[bursts]) < counts[bursts]:
        outcomes[bursts].extend(burst(url, min(size, counts[bursts] - len(outcomes[bursts])), args))
    for thread in threads:
        thread.join()
    return {name: {"sent": len(outcomes[name]), "expected": sorted(map(str, FAULTS[name][1])),
                   "got": dict(Counter(map(str, outcomes[name]))),
                   "unexpected": sum(outcome not in FAULTS[name][1] for outcome in outcomes[name])}
            for name in FAULTS}


def good_requests(url: str, stop: threading.Event, tally: dict) -> None:
    """Good requests one after another until ``stop``, each read and checked by the served teacher's client."""
    wire = Wire(url, api_key=KEY, request_timeout_s=120, retry_timeout_s=120)
    while not stop.is_set():
        tally["sent"] += 1
        try:
            path, body = request_body("vllm", "teacher", GOOD_ROWS, 2)
            status, answer = wire.post(path, body)
            read_response("vllm", answer, GOOD_ROWS, [list(range(1, len(GOOD_ROWS[0])))], 2, vocab_size=None)
            tally["answered"] += status == 200
        except (ValueError, ConnectionError) as error:
            tally.setdefault("errors", []).append(str(error)[:200])
        stop.wait(0.05)
    tally["retries"] = wire.retries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--requests", type=int, default=10_000, help="fault requests a round")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--slow-concurrency", type=int, default=32, help="requests that stall, at once")
    parser.add_argument("--read-timeout", type=float, default=2.0, help="the server's --read-timeout")
    parser.add_argument("--max-queue", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--start-timeout-s", type=float, default=300)
    parser.add_argument("--settle-s", type=float, default=3.0, help="wait before reading the memory after")
    parser.add_argument("--output", help="JSON result file (written atomically)")
    parser.add_argument("--check", action="store_true", help="exit 1 unless every fault got its status, every good "
                        "request was answered and the server's RSS grew by at most --max-growth-mib")
    parser.add_argument("--max-growth-mib", type=float, default=64.0)
    args = parser.parse_args(argv)
    server, url = start_server(args, ("--api-key", KEY, "--served-model-name", "teacher", "--read-timeout",
                                      str(args.read_timeout), "--max-model-len", str(args.max_model_len)))
    sampler = MemorySampler(server.pid, 0.25)
    load_before = os.getloadavg()
    try:
        warm = {"sent": 0, "answered": 0}
        stop = threading.Event()
        warming = threading.Thread(target=good_requests, args=(url, stop, warm))
        warming.start()
        time.sleep(2.0)
        stop.set()
        warming.join()
        before = sampler.process.memory_info().rss
        sampler.start()
        rounds = [abuse_round(url, args, sampler) for _ in range(args.rounds)]
    finally:
        sampler.stopped.set()
        server.terminate()
        server.wait(60)
    after = [each["rss_after_mib"] for each in rounds]
    peak = max([rss / MIB for _, rss in sampler.samples] + [before / MIB, *after])
    document = {"command": "python benchmarks/serve/serve_abuse.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "environment": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
                                "cores": os.cpu_count(),
                                "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]}},
                "config": {k: v for k, v in vars(args).items() if k not in ("output", "check")}, "rounds": rounds,
                "server_rss_mib": {"before": before / MIB, "after_each_round": after, "peak": peak}}
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(args.output, json.dumps(document, indent=1) + "\n")
    for number, each in enumerate(rounds, 1):
        for name, fault in each["faults"].items():
            print(f"round {number}: {name}: {fault['sent']} sent, got {fault['got']}, {fault['unexpected']} unexpected")
        good = each["good"]
        print(f"round {number}: good requests meanwhile: {good['answered']}/{good['sent']} answered "
              f"({good.get('retries', 0)} retries); {each['wall_s']:.1f} s")
    print(f"server RSS {before / MIB:.1f} MiB before, {', '.join(f'{mib:.1f}' for mib in after)} after each round, "
          f"{peak:.1f} peak")
    ok = all(fault["unexpected"] == 0 for each in rounds for fault in each["faults"].values()) and all(
        each["good"]["answered"] == each["good"]["sent"] > 0 for each in rounds) and (
        after[-1] - before / MIB <= args.max_growth_mib)
    return 0 if ok or not args.check else 1


def abuse_round(url: str, args: argparse.Namespace, sampler: MemorySampler) -> dict:
    """One round of the faults, good requests meanwhile; the server's RSS once it has settled after."""
    good, stop = {"sent": 0, "answered": 0}, threading.Event()
    meanwhile = threading.Thread(target=good_requests, args=(url, stop, good))
    meanwhile.start()
    started = time.monotonic()
    faults = run_faults(url, args)
    wall = time.monotonic() - started
    stop.set()
    meanwhile.join()
    time.sleep(args.settle_s)
    return {"faults": faults, "good": good, "wall_s": wall,
            "rss_after_mib": sampler.process.memory_info().rss / MIB}


if __name__ == "__main__":
    sys.exit(main())
