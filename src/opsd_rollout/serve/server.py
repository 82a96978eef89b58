"""``opsd-rollout serve-teacher``: a teacher (a preset or a local checkpoint) behind the app, on uvicorn.

``ServeConfig`` is what the command line sets; ``TeacherServer`` builds the engine and the app and runs uvicorn,
in the foreground (``serve``, until interrupted) or on a thread (``start``/``stop``: tests, benchmarks, a notebook).
It binds to loopback unless told otherwise and prints the URL it serves once it is ready.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import uvicorn

from opsd_rollout import checks
from opsd_rollout.models import load_model
from opsd_rollout.modeling import max_positions_of, text_config
from opsd_rollout.placement import device_choice, dtype_choice, resolve_device, resolve_dtype
from opsd_rollout.serve.app import build_app
from opsd_rollout.serve.engine import EngineLimits, TeacherEngine
from opsd_rollout.serve.guard import timed_h11

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
HEAD_BYTES = 16 << 10
"""The longest request head (its line and headers) taken; a longer one is answered 400 (h11's own limit, said)."""


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """A served teacher: which model, where, who may ask, and how much it takes."""

    model: str
    """A built-in preset (``llama-small``) or a local checkpoint directory."""
    served_model_name: str | None = None
    """The name clients ask for (``model`` in requests, ``/v1/models``); ``None``: ``model`` as given."""
    host: str = LOOPBACK
    """The address to bind: loopback by default, so nothing off this machine can ask; ``0.0.0.0`` for every
    interface (then set ``api_key``)."""
    port: int = 8000
    """0: any free port (the printed URL says which)."""
    api_key: str | None = None
    """Requests must carry ``Authorization: Bearer <api_key>`` (all routes but ``/health``); ``None``: no key."""
    dtype: str = "auto"
    """``fp32``, ``bf16``, ``fp16``, or ``auto``: bf16 on a GPU, fp32 on the CPU (``placement.resolve_dtype``)."""
    device: str = "auto"
    """``cpu``, ``cuda``, ``cuda:N``, or ``auto``: a GPU when there is one, else the CPU."""
    seed: int | None = None
    """A preset's weights are drawn from this seed (``None``: the preset's own), as ``load_model`` does."""
    limits: EngineLimits = field(default_factory=EngineLimits)
    compact_answers: bool = True
    """Give our client the compact answer it asks for (the response positions only, packed arrays:
    ``opsd_rollout.compact_answer``); ``False``: vLLM's JSON to every client, as a vLLM server answers."""
    max_connections: int = 256
    """Connections at once (and requests in progress); one more is answered 503 until one closes (uvicorn's
    ``limit_concurrency``; our client retries a 503). With ``read_timeout_s`` and the largest body, what bounds the
    memory clients can make the server hold: a request head (``HEAD_BYTES``) and a body a connection."""
    read_timeout_s: float = 30.0
    """How long a client may take to send a request's head (from its connection's opening or its last answer: the
    connection is closed past it) and its body (from its head: 408): a client that stalls never keeps a connection."""

    def __post_init__(self) -> None:
        checks.integer("port", self.port, minimum=0)
        checks.integer("max_connections", self.max_connections)
        checks.number("read_timeout_s", self.read_timeout_s, above=0)
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be an address to bind (127.0.0.1, 0.0.0.0); got {self.host!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be a non-empty string or None")
        checks.boolean("compact_answers", self.compact_answers)
        dtype_choice(self.dtype)
        device_choice(self.device)

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


def limits_text(limits: EngineLimits) -> str:
    """The limits as the ready line says them, each by the flag that sets it."""
    return (f"up to {limits.max_batch_tokens:,} tokens a forward (--max-batch-tokens), {limits.max_queue} requests "
            f"waiting (--max-queue), top-{limits.max_logprobs} log-probabilities (--max-logprobs), "
            f"{limits.max_model_len:,} tokens a prompt (--max-model-len)")


class TeacherServer:
    """The model loaded, the engine started and the app built; ``serve()`` or ``start()`` to listen."""

    def __init__(self, config: ServeConfig, *, model: Any = None, tokenizer: Any = None):
        """``model``/``tokenizer``: an already loaded teacher (tests, a notebook) instead of ``config.model``."""
        self.config = config
        if model is None:
            device = resolve_device(config.device)
            model, tokenizer = load_model(config.model, dtype=resolve_dtype(config.dtype, device.partition(":")[0]),
                                          device=device, seed=config.seed)
        limits = config.limits
        positions = max_positions_of(model.config)
        if positions is not None and positions < limits.max_model_len:  # never past the model's positions
            limits = EngineLimits(max_batch_tokens=limits.max_batch_tokens, max_queue=limits.max_queue,
                                  max_logprobs=limits.max_logprobs, max_model_len=positions)
        self.engine = TeacherEngine(model, limits, vocab_size=text_config(model.config).vocab_size)
        self.app = build_app(self.engine, tokenizer, model_name=config.name, api_key=config.api_key,
                             compact_answers=config.compact_answers, read_timeout_s=config.read_timeout_s)
        self.uvicorn = uvicorn.Server(uvicorn.Config(
            self.app, host=config.host, port=config.port, log_level="warning", access_log=False, lifespan="off",
            limit_concurrency=config.max_connections, http=timed_h11(config.read_timeout_s),
            h11_max_incomplete_event_size=HEAD_BYTES))
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` once listening (the port the system gave for port 0)."""
        sockets = [s for server in getattr(self.uvicorn, "servers", []) for s in server.sockets]
        port = sockets[0].getsockname()[1] if sockets else self.config.port
        host = self.config.host if self.config.host not in ("0.0.0.0", "::") else LOOPBACK
        return f"http://{host}:{port}"

    def serve(self, out: TextIO = sys.stdout) -> None:
        """Listen in the foreground until interrupted; print the URL once ready."""
        self.start(ready_timeout_s=None)
        print(f"opsd-rollout: serving teacher {self.config.name!r} at {self.url} (POST {self.url}/v1/completions "
              f"with prompt_logprobs; {'key required' if self.config.api_key else 'no key'}; "
              f"{limits_text(self.engine.limits)})", file=out, flush=True)
        try:
            while self.thread is not None and self.thread.is_alive():
                self.thread.join(0.5)
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()

    def start(self, ready_timeout_s: float | None = 60.0) -> "TeacherServer":
        """Listen on a thread; return once it accepts connections (a ``RuntimeError`` if it failed to start)."""
        self.thread = threading.Thread(target=self.uvicorn.run, name="teacher-http", daemon=True)
        self.thread.start()
        started = time.monotonic()
        while not self.uvicorn.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the teacher server did not start on {self.config.host}:{self.config.port} (is "
                                   "the port taken?)")
            if ready_timeout_s is not None and time.monotonic() - started > ready_timeout_s:
                raise RuntimeError(f"the teacher server did not start within {ready_timeout_s:g} s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Stop listening, then the engine (queued requests finish first)."""
        self.uvicorn.should_exit = True
        if self.thread is not None:
            self.thread.join(30)
        self.engine.close()
