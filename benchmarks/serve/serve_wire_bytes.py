"""One-off reproducer of wire-bytes.json beside it (RESULTS.md, "The compact answer on the wire and in a step",
issue 51 part 1).

Bytes on the wire per response token, and the client's time to read them, for each way a served teacher is asked:
one training micro-batch's teacher request and response against our server (in this process, on loopback), as vLLM's
JSON and as the compact answer, beside the host cache the answer fills.

    python benchmarks/serve/serve_wire_bytes.py --models qwen2-tiny,qwen2-0.5b --top-ks 0,64 \\
        --output benchmarks/serve/wire-bytes.json

Each request is ``--rows`` rows of a ``--prompt``-token prompt and a ``--response``-token response (random ids
below 259, the byte tokenizer's; the top-k ids range over the model's whole vocabulary), exactly what
``ServedTeacher`` sends (``prompt_logprobs=k``; 0 for the ``sampled`` cache: the given token's own only). vLLM's
JSON answers every position of each row, prompt included (the protocol has no "from this position"), which is
counted: bytes per response token are the whole body's bytes over the response tokens. The compact answer holds the
response positions only, at the cache's dtype (``--cache-dtypes``, for the top-k cache; the sampled one is float32).
The host cache's bytes per token are its buffers' (k int32 ids and k values, or one float32).

The decode time is the client's, from the body received to the cache written: for JSON ``json.loads``, the checked
reading (``served.read_json``) and the copy into the cache; for the compact answer its checked reading
(``compact_answer.read``) and the copy. Both are timed on the same answer, alternating, ``--repeats`` times each after
a warm-up; medians. The bytes are exact; the times depend on the machine and its load (recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import torch

from opsd_rollout import compact_answer
from opsd_rollout.files import write_text_atomic
from opsd_rollout.models import load_model
from opsd_rollout.modeling import text_config
from opsd_rollout.opsd.served import fill_cache, read_json
from opsd_rollout.opsd.served_wire import request_body
from opsd_rollout.serve import EngineLimits, ServeConfig, TeacherServer


def post(url: str, path: str, body: dict, accept: str) -> tuple[int, bytes, int]:
    """(request bytes, response body, response header bytes) of one call."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json",
                                                                     "Accept": accept})
    with urllib.request.urlopen(request, timeout=600) as answer:
        status_line = len(f"HTTP/1.1 {answer.status} {answer.reason}\r\n")
        return len(data), answer.read(), status_line + len(answer.headers.as_bytes())


def decode_times(rows: list[list[int]], positions: list[list[int]], k: int, vocab: int, dtype: torch.dtype,
                 raw_json: bytes, raw_compact: bytes, repeats: int) -> dict[str, float]:
    """Median seconds to read each answer into the cache, the two alternating on the same buffers."""
    window = len(positions[0])
    places = [(row, torch.arange(window)) for row in range(len(rows))]
    values = torch.zeros((len(rows), window, k) if k else (len(rows), window), dtype=dtype if k else torch.float32)
    indices = torch.zeros((len(rows), window, k), dtype=torch.int32) if k else None
    wire = "float32" if k == 0 else compact_answer.value_dtype(dtype)
    body = bytearray(raw_compact)  # as the client receives it: read into one buffer

    def from_json() -> None:
        fill_cache(values, indices, places, read_json("vllm", json.loads(raw_json), rows, positions, k, vocab))

    def from_compact() -> None:
        fill_cache(values, indices, places, compact_answer.read(body, rows, positions, k, wire, vocab))

    readers = {"json": from_json, "compact": from_compact}
    for reader in readers.values():  # warm-up
        reader()
    times: dict[str, list[float]] = {name: [] for name in readers}
    for repeat in range(repeats):
        for name in (("json", "compact") if repeat % 2 == 0 else ("compact", "json")):
            started = time.perf_counter()
            readers[name]()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def measure(url: str, name: str, vocab: int, rows: list[list[int]], prompt: int, k: int, dtype: torch.dtype,
            repeats: int) -> dict:
    """One request answered both ways: its bytes and its decode times, beside the cache's bytes."""
    positions = [list(range(prompt, len(row))) for row in rows]
    tokens = sum(len(wanted) for wanted in positions)
    wire = "float32" if k == 0 else compact_answer.value_dtype(dtype)
    path, body = request_body("vllm", name, rows, k)
    sent_json, raw_json, head_json = post(url, path, body, "application/json")
    path, body = request_body("vllm", name, rows, k, starts=[prompt] * len(rows), dtype=wire)
    sent_compact, raw_compact, head_compact = post(url, path, body, compact_answer.content_type())
    seconds = decode_times(rows, positions, k, vocab, dtype, raw_json, raw_compact, repeats)
    cache = 4 if k == 0 else k * (4 + dtype.itemsize)
    return {"model": name, "vocab_size": vocab, "cache": "sampled" if k == 0 else f"top{k}",
            "cache_dtype": str(dtype).removeprefix("torch.") if k else "float32", "response_tokens": tokens,
            "cache_bytes_per_token": cache,
            "json": {"request_bytes": sent_json, "response_bytes": len(raw_json), "http_header_bytes": head_json,
                     "response_bytes_per_token": len(raw_json) / tokens,
                     "decode_us_per_token": seconds["json"] / tokens * 1e6},
            "compact": {"request_bytes": sent_compact, "response_bytes": len(raw_compact),
                        "http_header_bytes": head_compact, "response_bytes_per_token": len(raw_compact) / tokens,
                        "with_http_headers_per_token": (len(raw_compact) + head_compact) / tokens,
                        "decode_us_per_token": seconds["compact"] / tokens * 1e6},
            "compact_over_cache": len(raw_compact) / tokens / cache,
            "decode_json_over_compact": seconds["json"] / seconds["compact"]}


def report(r: dict) -> str:
    json_, compact = r["json"], r["compact"]
    return (f"{r['model']} (V={r['vocab_size']:,}) {r['cache']} {r['cache_dtype']}: per response token, JSON "
            f"{json_['response_bytes_per_token']:,.1f} B, compact {compact['response_bytes_per_token']:,.2f} B "
            f"({compact['with_http_headers_per_token']:,.2f} with HTTP headers), the cache "
            f"{r['cache_bytes_per_token']} B: compact {r['compact_over_cache']:.3f}x the cache; decode JSON "
            f"{json_['decode_us_per_token']:.2f} us, compact {compact['decode_us_per_token']:.3f} us "
            f"({r['decode_json_over_compact']:.0f}x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen2-tiny,qwen2-0.5b")
    parser.add_argument("--top-ks", default="0,64", help="0: the sampled cache; k: the top-k cache")
    parser.add_argument("--cache-dtypes", default="float32", help="the top-k cache's dtypes (float32, bfloat16)")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20, help="timed reads of each answer")
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    rows = torch.randint(3, 259, (args.rows, args.prompt + args.response),
                         generator=torch.Generator().manual_seed(0)).tolist()
    results, load = [], [os.getloadavg()[0]]
    for name in args.models.split(","):
        model, tokenizer = load_model(name)
        vocab = text_config(model.config).vocab_size
        server = TeacherServer(ServeConfig(model=name, port=0, limits=EngineLimits(max_logprobs=64)), model=model,
                               tokenizer=tokenizer).start()
        try:
            for k in (int(k) for k in args.top_ks.split(",")):
                for dtype in ([torch.float32] if k == 0 else [getattr(torch, d) for d in args.cache_dtypes.split(",")]):
                    results.append(measure(server.url, name, vocab, rows, args.prompt, k, dtype, args.repeats))
                    load.append(os.getloadavg()[0])
                    print(report(results[-1]), flush=True)
        finally:
            server.stop()
        del model
    if args.output:
        write_text_atomic(Path(args.output), json.dumps({
            "command": " ".join(["python", "benchmarks/serve/serve_wire_bytes.py", *(argv or sys.argv[1:])]),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
            "load_average_1min": {"min": min(load), "max": max(load)}, "rows": args.rows, "prompt": args.prompt,
            "response": args.response, "repeats": args.repeats, "when": time.strftime("%Y-%m-%d %H:%M"),
            "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
