"""Bytes on the wire per response token, for each way a served teacher is asked: what one training micro-batch's
teacher request and response weigh, against our server (in this process, on loopback) speaking vLLM's protocol.

    python scripts/serve_wire_bytes.py --models qwen2-tiny,qwen2-0.5b --top-ks 0,64 \
        --output benchmarks/serve/wire-bytes.json

Each request is ``--rows`` rows of a ``--prompt``-token prompt and a ``--response``-token response (random ids
below 259, the byte tokenizer's; the top-k ids range over the model's whole vocabulary), exactly what
``ServedTeacher`` sends (``prompt_logprobs=k``; 0 for the ``sampled`` cache: the given token's own only). The
server answers every position of each row, prompt included (the protocol has no "from this position"), which is
counted: bytes per response token are the whole response's bytes over the response tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import urllib.request
from pathlib import Path

import torch

from opsd_rollout.files import write_text_atomic
from opsd_rollout.models import load_model
from opsd_rollout.modeling import text_config
from opsd_rollout.opsd.served_wire import request_body
from opsd_rollout.serve import EngineLimits, ServeConfig, TeacherServer


def post(url: str, path: str, body: dict) -> tuple[int, int]:
    """(request bytes, response bytes) of one call."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as answer:
        return len(data), len(answer.read())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen2-tiny,qwen2-0.5b")
    parser.add_argument("--top-ks", default="0,64", help="0: the sampled cache; k: the top-k cache")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    rows = torch.randint(3, 259, (args.rows, args.prompt + args.response),
                         generator=torch.Generator().manual_seed(0)).tolist()
    results = []
    for name in args.models.split(","):
        model, tokenizer = load_model(name)
        vocab = text_config(model.config).vocab_size
        server = TeacherServer(ServeConfig(model=name, port=0, limits=EngineLimits(max_logprobs=64)), model=model,
                               tokenizer=tokenizer).start()
        try:
            for k in (int(k) for k in args.top_ks.split(",")):
                path, body = request_body("vllm", name, rows, k)
                sent, received = post(server.url, path, body)
                tokens = args.rows * args.response
                results.append({"model": name, "vocab_size": vocab, "cache": "sampled" if k == 0 else f"top{k}",
                                 "request_bytes": sent, "response_bytes": received, "response_tokens": tokens,
                                 "response_bytes_per_token": received / tokens,
                                 "request_bytes_per_token": sent / tokens})
                print(f"{name} (V={vocab:,}) {results[-1]['cache']}: {received / tokens:,.0f} response bytes and "
                      f"{sent / tokens:,.1f} request bytes per response token", flush=True)
        finally:
            server.stop()
        del model
    if args.output:
        write_text_atomic(Path(args.output), json.dumps({
            "command": " ".join(["python", "scripts/serve_wire_bytes.py", *(argv or sys.argv[1:])]),
            "machine": f"{platform.machine()}, {platform.python_version()}", "rows": args.rows,
            "prompt": args.prompt, "response": args.response, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
