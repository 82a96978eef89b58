"""What a served teacher says on the wire: one JSON request with retries (``Wire``), and the two protocols a
teacher server speaks, each a request body and a checked reading of the response.

- ``vllm``: vLLM's OpenAI-compatible ``POST /v1/completions`` with token-id prompts (a list of lists),
  ``max_tokens=1`` and ``prompt_logprobs=k``; each choice's ``prompt_logprobs`` is a list over the prompt's
  positions, ``null`` first, then ``{token id: {"logprob", "rank", "decoded_token"}}`` holding the top-k and the
  given token's own (k or k + 1 entries). ``opsd-rollout serve-teacher`` answers the same, or, asked for it,
  the compact answer (``opsd_rollout.compact_answer``: the response positions only, packed arrays).
- ``sglang``: SGLang's ``POST /generate`` with ``input_ids``, ``return_logprob``, ``logprob_start_len=0`` and
  ``top_logprobs_num=k``; each result's ``meta_info`` has ``input_token_logprobs`` (``[logprob, token id, text]``
  per position, the first logprob ``null``) and ``input_top_logprobs`` (a list of such triples per position).

Reading a response never guesses: a missing, short, out-of-order or non-finite field is a ``ValueError`` naming the
field (``choices[2].prompt_logprobs[17]``), so a bad server never becomes a silently wrong loss.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import torch

from opsd_rollout.compact_answer import check_logprobs, check_top_order

PROTOCOLS = ("vllm", "sglang")
JSON = "application/json"
RETRIED_STATUS = (429, 502, 503, 504)
"""HTTP statuses a request is retried on: the server's queue is full, or a proxy in front of it has no server."""


class Wire:
    """JSON over HTTP to one server: connection failures and busy answers retried with exponential backoff for up to
    ``retry_timeout_s``, then a ``ConnectionError`` that says so; any other refusal a ``ValueError`` with the
    server's message."""

    def __init__(self, url: str, *, api_key: str | None, request_timeout_s: float, retry_timeout_s: float,
                 first_backoff_s: float = 0.25, max_backoff_s: float = 8.0):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.request_timeout_s, self.retry_timeout_s = request_timeout_s, retry_timeout_s
        self.first_backoff_s, self.max_backoff_s = first_backoff_s, max_backoff_s
        self.retries = 0
        """Requests retried so far (all paths), for reports and tests."""
        self.stopping = threading.Event()
        """Set when the run stops: a request being retried gives up at once instead of at ``retry_timeout_s``."""

    def get(self, path: str) -> tuple[int, Any]:
        return self.call("GET", path, None)

    def post(self, path: str, payload: Any, accept: str = JSON) -> tuple[int, Any]:
        return self.call("POST", path, payload, accept)

    def call(self, method: str, path: str, payload: Any, accept: str = JSON) -> tuple[int, Any]:
        """``(status, body)`` of a 2xx answer, or of a 404 (the caller decides what a missing endpoint means): the
        body parsed when ``accept`` is JSON, else its bytes (a ``bytearray``), refused unless the server answered
        in the media type asked for."""
        started, backoff, failures = time.monotonic(), self.first_backoff_s, 0
        while True:
            try:
                return self._once(method, path, payload, accept)
            except _Retry as retry:
                failures += 1
                waited = time.monotonic() - started
                if waited + backoff > self.retry_timeout_s:
                    raise ConnectionError(
                        f"the teacher server at {self.url} did not answer {method} {path} for {waited:.0f} s "
                        f"({failures} tries, backing off up to {self.max_backoff_s:g} s): {retry.reason}") from None
                self.retries += 1
                if self.stopping.wait(backoff):
                    raise ConnectionError(f"the teacher server at {self.url} did not answer {method} {path}, and "
                                          f"the run stopped while it was retried: {retry.reason}") from None
                backoff = min(2 * backoff, self.max_backoff_s)

    def _once(self, method: str, path: str, payload: Any, accept: str) -> tuple[int, Any]:
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": JSON, "Accept": accept}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.request_timeout_s) as answer:
                if accept == JSON:
                    return answer.status, _json(answer.read(), path)
                given = answer.headers.get("Content-Type", "")
                if given.split(";")[0].strip().lower() != accept.split(";")[0].strip().lower():
                    raise ValueError(f"the teacher server at {self.url} answered {method} {path} with "
                                     f"{given or 'no Content-Type'}, not the {accept!r} asked for")
                return answer.status, _body(answer, f"{method} {path}")
        except urllib.error.HTTPError as error:
            body = error.read()
            if error.code in RETRIED_STATUS:
                raise _Retry(f"HTTP {error.code}: {_message(body)}") from None
            if error.code == 404:
                return 404, None
            refused = f"the teacher server at {self.url} refused {method} {path}: HTTP {error.code}: {_message(body)}"
            if error.code == 401:
                raise KeyRefused(refused, given=bool(self.api_key)) from None
            raise ValueError(refused) from None
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, socket.timeout, TimeoutError) \
                as error:
            raise _Retry(f"{type(error).__name__}: {getattr(error, 'reason', error)}") from None


class KeyRefused(ValueError):
    """The server wants a key (HTTP 401): none was sent, or not its own (``given``). The message says how a library
    caller gives one; ``refused`` is the server's answer alone, for a caller that names its own way."""

    def __init__(self, refused: str, *, given: bool):
        super().__init__(f"{refused} (give the server's key: ServedTeacher(api_key=...))")
        self.refused, self.given = refused, given


class _Retry(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _body(answer: http.client.HTTPResponse, what: str) -> bytearray:
    """The answer's body read into one writable buffer (its arrays are then read in place); a body that ends before
    its ``Content-Length`` is a transfer cut short, retried."""
    length = answer.headers.get("Content-Length", "")
    if not length.isdigit():
        return bytearray(answer.read())
    body = bytearray(int(length))
    view, got = memoryview(body), 0
    while got < len(body):
        read = answer.readinto(view[got:])
        if not read:
            raise _Retry(f"the answer to {what} ended after {got:,} of its {len(body):,} bytes (Content-Length)")
        got += read
    return body


def _json(raw: bytes, path: str) -> Any:
    try:
        return json.loads(raw) if raw.strip() else None
    except json.JSONDecodeError as error:
        raise ValueError(f"the teacher server's answer to {path} is not JSON ({error}): {raw[:200]!r}") from None


def _message(body: bytes) -> str:
    """The error message of a vLLM-shaped (``{"error": {"message": ...}}``) or FastAPI-shaped (``{"detail": ...}``)
    error body, else its first characters."""
    try:
        parsed = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return body[:300].decode(errors="replace")
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in parsed or "detail" in parsed:
            return str(parsed.get("message", parsed.get("detail")))
    return str(parsed)[:300]


@dataclass(frozen=True)
class RowLogprobs:
    """What a server gave for one row, at the n positions asked (``positions``: indices into the tokens sent)."""

    token: torch.Tensor
    """[n] float64: the given token's log-probability at each position."""
    top_ids: torch.Tensor
    """[n, k] int32: the k most likely token ids at each position, most likely first ([n, 0] when k is 0)."""
    top_logprobs: torch.Tensor
    """[n, k] float64: theirs."""


def request_body(protocol: str, model: str | None, rows: list[list[int]], k: int, *, starts: list[int] | None = None,
                 dtype: str | None = None) -> tuple[str, dict[str, Any]]:
    """``(path, body)`` asking for each row's log-probabilities at every position, with the top ``k``; with
    ``starts`` and ``dtype`` (our server's compact answer, ``protocol="vllm"`` only) from position ``starts[i]`` of
    row i on, the values in ``dtype``."""
    if protocol == "vllm":
        body = {"model": model, "prompt": rows, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": k,
                "return_token_ids": True}
        if starts is not None:
            body.update(prompt_logprobs_start=starts, prompt_logprobs_dtype=dtype, return_token_ids=False)
        return "/v1/completions", body
    return "/generate", {"input_ids": rows, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                         "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": k,
                         "return_text_in_logprobs": False}


def read_response(protocol: str, body: Any, rows: list[list[int]], positions: list[list[int]], k: int,
                  vocab_size: int | None) -> list[RowLogprobs]:
    """Each row's log-probabilities at its ``positions`` from a server's ``body``; every field checked."""
    read = _read_vllm if protocol == "vllm" else _read_sglang
    return [_checked_row(*read(body, rows, index), rows[index], positions[index], k, vocab_size)
            for index in range(len(rows))]


def _field(container: Any, key: Any, name: str, kind: type | tuple[type, ...]) -> Any:
    """``container[key]`` of ``kind``, else a ValueError naming the field ``name``."""
    try:
        value = container[key]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"the teacher's response lacks {name}") from None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"the teacher's response has {name} = {str(value)[:80]}: expected "
                         f"{getattr(kind, '__name__', kind)}")
    return value


def _read_vllm(body: Any, rows: list[list[int]], index: int) -> tuple[str, list[Any], Any]:
    """``(field name, per-position entries, entry reader)`` of one choice."""
    choices = _field({"choices": body} if isinstance(body, list) else body, "choices", "choices", list)
    if len(choices) != len(rows):
        raise ValueError(f"the teacher's response has {len(choices)} choices for {len(rows)} prompts (choices)")
    choice = _field(choices, index, f"choices[{index}]", dict)
    name = f"choices[{index}]"
    if choice.get("index", index) != index:
        raise ValueError(f"the teacher's response is out of order: {name}.index is {choice['index']!r}")
    sent = choice.get("prompt_token_ids")
    if sent is not None and list(sent) != rows[index]:
        raise ValueError(f"the teacher's response is out of order or altered: {name}.prompt_token_ids is not the "
                         f"prompt sent ({len(sent)} tokens, {len(rows[index])} sent)")
    return f"{name}.prompt_logprobs", _field(choice, "prompt_logprobs", f"{name}.prompt_logprobs", list), _vllm_entry


def _vllm_entry(entry: Any, name: str) -> list[tuple[int, float, int | None]]:
    """``[(token id, logprob, rank)]`` of one position's ``{id: {"logprob", "rank"}}`` (or ``{id: logprob}``)."""
    if not isinstance(entry, dict):
        raise ValueError(f"the teacher's response has {name} = {str(entry)[:80]}: expected a mapping of token ids")
    found = []
    for key, value in entry.items():
        try:
            token = int(key)
        except ValueError:
            raise ValueError(f"the teacher's response has a key {key!r} in {name}: expected a token id") from None
        if isinstance(value, dict):
            logprob, rank = _field(value, "logprob", f"{name}[{key!r}].logprob", (int, float)), value.get("rank")
        else:
            logprob, rank = _field(entry, key, f"{name}[{key!r}]", (int, float)), None
        found.append((token, float(logprob), rank if isinstance(rank, int) else None))
    return found


def _read_sglang(body: Any, rows: list[list[int]], index: int) -> tuple[str, list[Any], Any]:
    results = body if isinstance(body, list) else [body]
    if len(results) != len(rows):
        raise ValueError(f"the teacher's response has {len(results)} results for {len(rows)} prompts")
    meta = _field(_field(results, index, f"[{index}]", dict), "meta_info", f"[{index}].meta_info", dict)
    name = f"[{index}].meta_info"
    tokens = _field(meta, "input_token_logprobs", f"{name}.input_token_logprobs", list)
    tops = meta.get("input_top_logprobs") or [None] * len(tokens)
    if not isinstance(tops, list) or len(tops) != len(tokens):
        raise ValueError(f"the teacher's response has {name}.input_top_logprobs of "
                         f"{len(tops) if isinstance(tops, list) else type(tops).__name__} positions for "
                         f"{len(tokens)} in input_token_logprobs")
    return f"{name}.input_token_logprobs", list(zip(tokens, tops)), _sglang_entry


def _sglang_entry(entry: tuple[Any, Any], name: str) -> list[tuple[int, float, int | None]]:
    """``[(token id, logprob, rank)]``: the given token's triple first (rank 0: the token the server scored there),
    then the top list's in order (ranks 1, 2, ...)."""
    given, top = entry
    triples = [given] + list(top or [])
    found = []
    for place, triple in enumerate(triples):
        where = name if place == 0 else f"{name.replace('input_token_logprobs', 'input_top_logprobs')}[{place - 1}]"
        if not isinstance(triple, (list, tuple)) or len(triple) < 2:
            raise ValueError(f"the teacher's response has {where} = {str(triple)[:80]}: expected "
                             "[logprob, token id, text]")
        logprob, token = triple[0], triple[1]
        if not isinstance(logprob, (int, float)) or isinstance(logprob, bool):
            raise ValueError(f"the teacher's response has {where} logprob {logprob!r}: expected a number")
        if not isinstance(token, int) or isinstance(token, bool):
            raise ValueError(f"the teacher's response has {where} token id {token!r}: expected an int")
        found.append((token, float(logprob), place))
    return found


def _checked_row(name: str, entries: list[Any], reader: Any, sent: list[int], positions: list[int], k: int,
                 vocab_size: int | None) -> RowLogprobs:
    if len(entries) != len(sent):
        raise ValueError(f"the teacher's response has {len(entries)} positions in {name} for {len(sent)} tokens "
                         f"sent")
    token_lp, top_ids, top_lp = [], [], []
    for position in positions:
        where = f"{name}[{position}]"
        found = reader(entries[position], where)
        if found and found[0][2] == 0 and found[0][0] != sent[position]:  # SGLang names the token it scored
            raise ValueError(f"the teacher's response is out of order: {where} is token {found[0][0]}, and the "
                             f"token sent there is {sent[position]}")
        given = [logprob for token, logprob, _ in found if token == sent[position]]
        if not given:
            raise ValueError(f"the teacher's response lacks the given token {sent[position]} in {where} (out of "
                             f"order, or not the tokens sent)")
        for token, _, _ in found:
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise ValueError(f"the teacher's response has token id {token} in {where}, outside the vocabulary "
                                 f"[0, {vocab_size})")
        token_lp.append(given[0])
        if k:  # the ranked entries are the top-k (the given token's own may be past k); unranked ones by value
            ranks = {token: (rank, -logprob, logprob) for token, logprob, rank in found if rank}
            ranked = sorted((ranks or {token: (0, -logprob, logprob) for token, logprob, _ in found}).items(),
                            key=lambda item: item[1][:2])
            if len(ranked) < k:
                raise ValueError(f"the teacher's response has {len(ranked)} tokens in {where}, fewer than the top "
                                 f"{k} asked (vLLM: serve with --max-logprobs >= {k})")
            ranked = ranked[:k]
            top_ids.append([token for token, _ in ranked])
            top_lp.append([entry[2] for _, entry in ranked])
    answer = RowLogprobs(torch.tensor(token_lp, dtype=torch.float64),
                         torch.tensor(top_ids, dtype=torch.int32).reshape(len(positions), k),
                         torch.tensor(top_lp, dtype=torch.float64).reshape(len(positions), k))

    def where(index: int) -> str:
        return f"{name}[{positions[index]}]"

    check_logprobs(answer.token, where)
    check_logprobs(answer.top_logprobs, where)
    check_top_order(answer.top_logprobs, where)  # the ranks' order is the log-probabilities'
    return answer
