"""A teacher on another machine: its log-probabilities over a rollout, asked of a server and cached on the host as
the in-process teacher's are (``TeacherCache``), so ``opsd_step`` and its losses read them alike.

``opsd_step(engine, ServedTeacher("http://host:8000", model="teacher"), rollout, ...)`` sends each row's real
tokens (padding and holes in the mask left out, which is what the in-process teacher's mask and positions compute)
up to its last response token, and reads, at every response position, the teacher's log-probability of the token
the student sampled (a ``sampled`` cache, for ``sampled_reverse_kl``) or its top-k tokens and their
log-probabilities (a ``topk`` cache, for the divergences; ``DivergenceConfig(top_k_rest="tail")`` keeps the rest of
the teacher's mass as one bucket). A ``full`` cache is refused before any work: no server sends a whole vocabulary
per token. Servers: vLLM's OpenAI-compatible server and ``opsd-rollout serve-teacher`` (``protocol="vllm"``),
SGLang's native ``/generate`` (``protocol="sglang"``); see ``served_wire``. Our own server, when its ``/v1/models``
says it gives it, is asked for the compact answer instead of vLLM's JSON (``opsd_rollout.compact_answer``: the
response positions only, packed arrays copied into the cache as they are).
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from opsd_rollout import checks, compact_answer
from opsd_rollout.opsd.served_wire import PROTOCOLS, Wire, read_response, request_body
from opsd_rollout.opsd.targets import ResponseTargets, TargetSource, response_targets
from opsd_rollout.opsd.teacher import TeacherCache, TeacherCacheBuffers, TeacherCacheConfig, plan_mode
from opsd_rollout.profiling import NULL_RECORDER

if TYPE_CHECKING:
    from opsd_rollout.profiling.recorder import Recorder

logger = logging.getLogger(__name__)

PROBE = "On-policy distillation: the student samples, the teacher scores 123 tokens."
"""The text both tokenizers encode at connect time: the same ids, or the teacher is scoring other tokens."""

RowAnswer = tuple[torch.Tensor, "torch.Tensor | None"]
"""One row's answer at its wanted positions: log-probabilities ([n] sampled, [n, k] top-k) and ids ([n, k] int32,
``None`` for the sampled cache)."""


class ServedTeacher:
    """A teacher behind an HTTP server, as ``opsd_step``'s ``teacher``.

    ``url``: the server (``http://127.0.0.1:8000``); ``model``: the served model's name (``None``: the only one it
    serves); ``api_key``: sent as ``Authorization: Bearer`` (vLLM's ``--api-key``); ``protocol``: ``vllm`` (also
    ours) or ``sglang``; ``tokenizer``: the student's, compared with the server's ``/tokenize`` at connect time;
    ``rows_per_request``: rows sent in one request; ``concurrency``: requests in flight at once (the server batches
    them); ``request_timeout_s``: one request's limit; ``retry_timeout_s``: how long connection failures and busy
    answers are retried, with exponential backoff, before a ``ConnectionError``; ``overlap``: ``opsd_step`` sends
    its request in the background and runs the student's forward while it is in flight (and ``train`` with gradient
    accumulation rolls out the next micro-batches then); ``False``: each step waits for its answer before going on
    (the same losses, every latency exposed)."""

    def __init__(self, url: str, *, model: str | None = None, api_key: str | None = None, protocol: str = "vllm",
                 tokenizer: Any = None, rows_per_request: int = 8, concurrency: int = 4,
                 request_timeout_s: float = 600.0, retry_timeout_s: float = 120.0, overlap: bool = True):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be the teacher server's http:// or https:// address; got {url!r}")
        checks.choice("protocol", protocol, PROTOCOLS)
        checks.integer("rows_per_request", rows_per_request)
        checks.integer("concurrency", concurrency)
        checks.number("request_timeout_s", request_timeout_s, above=0)
        checks.number("retry_timeout_s", retry_timeout_s, at_least=0)
        self.wire = Wire(url, api_key=api_key, request_timeout_s=request_timeout_s, retry_timeout_s=retry_timeout_s)
        self.model, self.protocol, self.tokenizer = model, protocol, tokenizer
        self.rows_per_request, self.concurrency, self.overlap = rows_per_request, concurrency, bool(overlap)
        self._sender: ThreadPoolExecutor | None = None  # one thread: the steps' requests, in the order sent
        self.vocab_size: int | None = None
        """The server's vocabulary size when it says (ours does, in ``/v1/models``); ``None`` otherwise."""
        self.compact = False
        """Whether the server is asked for the compact answer (it said it gives this client's version)."""
        self.connected = False

    @property
    def url(self) -> str:
        return self.wire.url

    def __repr__(self) -> str:
        return f"ServedTeacher({self.url!r}, model={self.model!r}, protocol={self.protocol!r})"

    def connect(self, student_vocab_size: int | None = None) -> None:
        """Check, once, that the server answers, serves ``model``, and has the student's tokenizer and vocabulary;
        each failure a one-line error naming both sides."""
        if self.connected:
            return
        self.wire.get("/health")
        status, listing = self.wire.get("/v1/models")
        cards = listing.get("data") if status == 200 and isinstance(listing, dict) else None
        if isinstance(cards, list) and cards:
            served = [card.get("id") for card in cards if isinstance(card, dict)]
            if self.model is None:
                if len(served) != 1:
                    raise ValueError(f"the teacher server at {self.url} serves {served}: name one (model=...)")
                self.model = served[0]
            elif self.model not in served:
                raise ValueError(f"the teacher server at {self.url} serves {served}, not {self.model!r}")
            card = cards[served.index(self.model)]
            self.vocab_size = card.get("vocab_size") if isinstance(card.get("vocab_size"), int) else None
            self.compact = self.protocol == "vllm" and self._speaks_compact(card.get("compact_answer_version"))
        elif self.model is None:
            raise ValueError(f"the teacher server at {self.url} lists no model at /v1/models: name it (model=...)")
        if student_vocab_size is not None and self.vocab_size is not None and self.vocab_size != student_vocab_size:
            raise ValueError(f"the teacher's vocabulary ({self.vocab_size:,} tokens, {self.url}) differs from the "
                             f"student's ({student_vocab_size:,}): distillation compares them token by token")
        self.vocab_size = self.vocab_size or student_vocab_size
        self._check_tokenizer()
        self.connected = True

    def _speaks_compact(self, version: Any) -> bool:
        """Whether to ask for the compact answer: the server gives this client's version; another version is refused
        in one line (neither side reads the other's)."""
        if version is None:
            return False
        if version != compact_answer.VERSION:
            raise ValueError(f"the teacher server at {self.url} gives the compact answer version {version!r}, and this "
                             f"client reads version {compact_answer.VERSION}: run the same opsd-rollout release on "
                             "both sides (or serve-teacher --no-compact-answers for vLLM's JSON)")
        return True

    def _check_tokenizer(self) -> None:
        if self.tokenizer is None:
            return
        status, answer = self.wire.post("/tokenize", {"model": self.model, "prompt": PROBE,
                                                      "add_special_tokens": False})
        if status == 404:
            logger.warning("the teacher server at %s has no /tokenize: its tokenizer is not compared with the "
                           "student's", self.url)
            return
        theirs = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(theirs, list):
            raise ValueError(f"the teacher server's /tokenize answer lacks 'tokens': {str(answer)[:200]}")
        ours = list(self.tokenizer(PROBE, add_special_tokens=False)["input_ids"])
        if theirs != ours:
            raise ValueError(f"the teacher's tokenizer ({self.url}) differs from the student's: {PROBE[:24]!r}... is "
                             f"{theirs[:8]}... ({len(theirs)} tokens) there and {ours[:8]}... ({len(ours)}) here")

    def build_cache(self, targets: TargetSource, config: TeacherCacheConfig, *, recorder: Recorder = NULL_RECORDER,
                    buffers: TeacherCacheBuffers | None = None, pin: bool = False) -> TeacherCache:
        """The teacher's cache over ``targets``' response window (``build_teacher_cache``'s, from the server):
        ``sampled`` [N, R] or ``topk`` ([N, R, k] log-probabilities, [N, R, k] int32 ids)."""
        refuse_full_cache(config)
        self.connect()
        targets = response_targets(targets)
        rows, window = targets.labels.shape
        buffers = buffers if buffers is not None else TeacherCacheBuffers()
        sampled = config.mode == "sampled"
        k = 0 if sampled else config.top_k if self.vocab_size is None else min(config.top_k, self.vocab_size)
        dtype = torch.float32 if sampled else config.dtype or torch.float32
        budget = config.budget(buffers.nbytes)
        plan_mode(config, rows, window, self.vocab_size or k, dtype, budget)  # refuses over the budget
        sent, positions, places = rows_to_send(targets)
        with recorder.stage("teacher_forward"):
            answers = self._ask(sent, positions, k, "float32" if sampled else compact_answer.value_dtype(dtype))
        with recorder.stage("cache_write"):
            if sampled:
                values = buffers.take("values", (rows, window), torch.float32, pin).zero_()
                fill_cache(values, None, places, answers)
                return TeacherCache(values, None, budget_bytes=budget, sampled=True)
            values = buffers.take("values", (rows, window, k), dtype, pin).fill_(-math.log(k + 1))
            indices = buffers.take("indices", (rows, window, k), torch.int32, pin)
            indices.copy_(torch.arange(k, dtype=torch.int32))  # untrained positions: k distinct tokens, finite
            fill_cache(values, indices, places, answers)
        return TeacherCache(values, indices, budget_bytes=budget)

    def submit(self, targets: TargetSource, config: TeacherCacheConfig, *, buffers: TeacherCacheBuffers | None = None,
               pin: bool = False) -> "InFlight":
        """``build_cache`` in the background: the answer in flight while the caller works. Requests go out one
        step after another, in the order submitted; ``buffers`` must not be another pending answer's."""
        if self._sender is None:
            self.wire.stopping.clear()
            self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="served-teacher")
        return InFlight(self._sender, self.build_cache, targets, config, buffers=buffers, pin=pin)

    def close(self) -> None:
        """Stop the background sender: the answers not yet asked for are dropped, a request being retried gives
        up; a later ``submit`` starts another sender."""
        if self._sender is not None:
            self.wire.stopping.set()
            self._sender.shutdown(wait=False, cancel_futures=True)
            self._sender = None

    def _ask(self, sent: list[list[int]], positions: list[list[int]], k: int, dtype: str) -> list[RowAnswer]:
        """Every row's answer, ``rows_per_request`` rows a request, ``concurrency`` requests in flight; the compact
        answer's values in ``dtype``."""
        groups = [range(start, min(start + self.rows_per_request, len(sent)))
                  for start in range(0, len(sent), self.rows_per_request)]

        def ask(group: range) -> list[RowAnswer]:
            rows, wanted = [sent[i] for i in group], [positions[i] for i in group]
            if self.compact:
                path, body = request_body(self.protocol, self.model, rows, k, starts=[row[0] for row in wanted],
                                          dtype=dtype)
                status, answer = self.wire.post(path, body, accept=compact_answer.content_type())
            else:
                path, body = request_body(self.protocol, self.model, rows, k)
                status, answer = self.wire.post(path, body)
            if status == 404:
                raise ValueError(f"the teacher server at {self.url} has no {path} (protocol={self.protocol!r}: "
                                 f"vllm for vLLM's and ours, sglang for SGLang's /generate)")
            if self.compact:
                return compact_answer.read(answer, rows, wanted, k, dtype, self.vocab_size)
            return read_json(self.protocol, answer, rows, wanted, k, self.vocab_size)

        if len(groups) <= 1 or self.concurrency == 1:
            return [row for group in groups for row in ask(group)]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(groups))) as pool:
            return [row for answer in pool.map(ask, groups) for row in answer]


class InFlight:
    """A served teacher's cache on its way (``ServedTeacher.submit``): ``result()`` waits for it (raising what the
    request raised), ``latency_ms`` is the time from sending to the cache written."""

    def __init__(self, pool: ThreadPoolExecutor, fn: Any, *args: Any, **kwargs: Any):
        self.sent = time.perf_counter()
        self.latency_ms = 0.0

        def timed() -> TeacherCache:
            try:
                return fn(*args, **kwargs)
            finally:
                self.latency_ms = (time.perf_counter() - self.sent) * 1e3

        self.future = pool.submit(timed)

    def result(self) -> TeacherCache:
        return self.future.result()

    def cancel(self) -> None:
        """Drop it if it has not started (a run stopping with steps in flight)."""
        self.future.cancel()


def read_json(protocol: str, body: Any, rows: list[list[int]], positions: list[list[int]], k: int,
              vocab_size: int | None) -> list[RowAnswer]:
    """Each row's answer from a server's parsed JSON ``body`` (``served_wire.read_response``, every field checked)."""
    return [(answer.token, None) if k == 0 else (answer.top_logprobs, answer.top_ids)
            for answer in read_response(protocol, body, rows, positions, k, vocab_size)]


def fill_cache(values: torch.Tensor, indices: torch.Tensor | None, places: list[tuple[int, torch.Tensor]],
               answers: list[RowAnswer]) -> None:
    """Copy each row's answer into the cache at its ``(row, window columns)`` place (``rows_to_send``'s): one slice
    copy a row where its columns are consecutive, converted to the cache's dtype as it copies."""
    for (row, columns), (got, ids) in zip(places, answers):
        first, last = int(columns[0]), int(columns[-1])
        if last - first + 1 == len(columns):
            values[row, first:last + 1].copy_(got)
            if indices is not None and ids is not None:
                indices[row, first:last + 1].copy_(ids)
        else:
            values[row, columns] = got.to(values.dtype)
            if indices is not None and ids is not None:
                indices[row, columns] = ids


def refuse_full_cache(config: TeacherCacheConfig) -> None:
    """A served teacher sends k tokens' log-probabilities a position, never its whole vocabulary: a ``full`` cache
    (and the losses that need it) is refused before any work."""
    if config.mode == "full":
        raise ValueError("a served teacher sends the log-probabilities of its top-k tokens (or of the sampled token) "
                         "per position, not its whole vocabulary: use TeacherCacheConfig(mode='topk') for "
                         "forward_kl, reverse_kl and jsd (with DivergenceConfig(top_k_rest='tail') to keep the rest "
                         "of its mass), or mode='sampled' for sampled_reverse_kl (--teacher-cache topk or sampled)")


def rows_to_send(targets: ResponseTargets) -> tuple[list[list[int]], list[list[int]], list[tuple[int, torch.Tensor]]]:
    """For each row with a response token to train on: the tokens to send (its real tokens, mask 1, up to its last
    trained one), the positions among them whose log-probabilities are wanted, and where those go in the cache
    (``(row, window columns)``). A position's log-probability is of its token given the real tokens before it, what
    the in-process teacher computes with the row's mask and positions."""
    mask = targets.attention_mask.bool().cpu()
    trained = targets.mask.cpu()
    ids = targets.input_ids.cpu()
    sent, positions, places = [], [], []
    for row in range(ids.shape[0]):
        columns = trained[row].nonzero().squeeze(1)  # window columns j: sequence column P + j
        if columns.numel() == 0:
            continue
        last = targets.prompt_length + int(columns[-1])
        real = mask[row, :last + 1]
        index = real.long().cumsum(0) - 1  # sequence column -> its place among the real tokens
        wanted = index[targets.prompt_length + columns]
        if int(wanted[0]) < 1:
            raise ValueError(f"row {row}'s first response token has no real token before it (an empty prompt): a "
                             "served teacher scores a token from the ones before it")
        sent.append(ids[row, :last + 1][real].tolist())
        positions.append(wanted.tolist())
        places.append((row, columns))
    return sent, positions, places
