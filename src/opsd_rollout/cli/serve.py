"""``opsd-rollout serve-teacher``: its flags, each mapped onto ``ServeConfig``/``EngineLimits``. A light module
(argparse only), so ``--help`` answers without importing torch; the command imports the server when it runs."""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
from typing import Any

from opsd_rollout import checks
from opsd_rollout.cli.common import add_placement_flags
from opsd_rollout.presets import PRESETS


def run_serve_teacher(args: argparse.Namespace) -> int:
    """Check the model's name before loading anything, then serve in the foreground until interrupted."""
    if args.model not in PRESETS and not os.path.isdir(args.model):  # before loading anything
        raise ValueError(f"--model {args.model!r} is neither a built-in preset (opsd-rollout models) nor a local "
                         "checkpoint directory (this tool never downloads)")
    check_address(args.host, args.port)
    from opsd_rollout.serve.engine import EngineLimits  # heavy: torch
    from opsd_rollout.serve.server import ServeConfig, TeacherServer  # heavy: torch, transformers, uvicorn

    limits = EngineLimits(max_batch_tokens=args.max_batch_tokens, max_queue=args.max_queue,
                          max_logprobs=args.max_logprobs, max_model_len=args.max_model_len)
    config = ServeConfig(model=args.model, served_model_name=args.served_model_name, host=args.host, port=args.port,
                         api_key=args.api_key or os.environ.get("OPSD_ROLLOUT_API_KEY") or None, dtype=args.dtype,
                         device=args.device, seed=args.seed, limits=limits, compact_answers=args.compact_answers,
                         max_connections=args.max_connections, read_timeout_s=args.read_timeout)
    if config.host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        print(f"opsd-rollout: warning: serving on {config.host} without --api-key: anyone who reaches this port can "
              "query the teacher", file=sys.stderr)
    TeacherServer(config).serve()
    return 0


def check_address(host: str, port: int) -> None:
    """Refuses, before the model loads, an address this process could not listen on: a port another process holds
    (port 0 is any free one) or a host that is not this machine's. A probe bound and closed at once, as uvicorn will
    bind it (``SO_REUSEADDR``: a port left in TIME_WAIT by a past server is free)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise ValueError(f"--host {host!r} is no address to listen on: {error.strerror}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise ValueError(f"--port {port} is taken on {host}: another process listens on it; choose another "
                                 "port (--port 0 takes a free one and prints it)") from None
            raise ValueError(f"--host {host} --port {port}: cannot listen there: {error.strerror}") from None


def add_serve_teacher_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    serve = sub.add_parser("serve-teacher", parents=[common], help="serve a teacher's log-probabilities over HTTP "
                           "(vLLM's /v1/completions with prompt_logprobs)",
                           description="Serve a teacher's log-probabilities for given token ids through the part of "
                           "vLLM's OpenAI-compatible API a teacher needs: POST /v1/completions (token-id prompts, "
                           "prompt_logprobs=k), GET /v1/models, POST /tokenize, GET /health. Concurrent requests are "
                           "batched up to --max-batch-tokens; a request over a limit is refused with a 4xx naming it. "
                           "Binds to loopback unless --host says otherwise; with --api-key (or OPSD_ROLLOUT_API_KEY) "
                           "every route but /health wants 'Authorization: Bearer KEY'. Prints the URL once ready. "
                           "Clients: train --teacher-url, opsd.ServedTeacher, anything that speaks vLLM's API.")
    serve.add_argument("--model", required=True, help="the teacher: a built-in preset or a local checkpoint "
                       "directory")
    serve.add_argument("--served-model-name", help="the name clients ask for (default: --model as given)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s: this machine "
                       "only; 0.0.0.0 for every interface, then set --api-key)")
    serve.add_argument("--port", type=checks.argument(checks.integer, minimum=0), default=8000,
                       help="port (default %(default)s; 0 picks a free one)")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (as vLLM's --api-key; default: "
                       "$OPSD_ROLLOUT_API_KEY, else no key; the variable keeps the key off the command line, which "
                       "every user of the machine can read)")
    add_placement_flags(serve, "the teacher")
    serve.add_argument("--seed", type=int, help="a preset's weight seed (default: the preset's own)")
    serve.add_argument("--max-batch-tokens", type=checks.argument(checks.integer), default=8192,
                       help="token positions (rows x longest row) in one teacher forward; a request must fit one "
                       "(default %(default)s)")
    serve.add_argument("--max-queue", type=checks.argument(checks.integer), default=64,
                       help="requests waiting for the teacher; past it a request gets 429 (default %(default)s)")
    serve.add_argument("--max-logprobs", type=checks.argument(checks.integer, minimum=0), default=64,
                       help="largest prompt_logprobs k (as vLLM's --max-logprobs; default %(default)s)")
    serve.add_argument("--max-model-len", type=checks.argument(checks.integer), default=2048,
                       help="tokens in one prompt, at most the model's positions (default %(default)s)")
    serve.add_argument("--max-connections", type=checks.argument(checks.integer), default=256,
                       help="connections at once; one more gets 503 until one closes (default %(default)s)")
    serve.add_argument("--read-timeout", type=checks.argument(checks.number, float, above=0), default=30.0,
                       metavar="SECONDS", help="how long a client may take to send a request's head (else its "
                       "connection is closed) and its body (else 408) (default %(default)s)")
    serve.add_argument("--no-compact-answers", dest="compact_answers", action="store_false",
                       help="answer vLLM's JSON to every client, as vLLM does (default: the compact answer, the "
                       "response positions as packed arrays, to an opsd-rollout client that asks for it)")
    serve.set_defaults(func=run_serve_teacher)
