"""The HTTP app: a thin FastAPI layer over a ``TeacherEngine`` (validate, queue, await, answer), vLLM's routes and
shapes: ``GET /health``, ``GET /v1/models``, ``POST /tokenize``, ``POST /v1/completions`` (token-id prompts,
``prompt_logprobs``). With an API key, every route but ``/health`` wants ``Authorization: Bearer KEY`` (vLLM's
``--api-key``). Errors are vLLM's JSON body with the status: 400 a bad request (the field named), 401 no or a wrong
key, 404 another model, 408 a body that did not arrive in time, 413 a request over ``max_batch_tokens`` (or a body
larger than such a request's), 429 the queue full; the limit a request broke is named in the message. What a
request must be before a route sees it (its size, its key, its pace) is ``guard.RequestGuard``'s."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from opsd_rollout import compact_answer
from opsd_rollout.compact_answer import check_logprobs
from opsd_rollout.serve.engine import LimitExceeded, RowScores, TeacherEngine
from opsd_rollout.serve.guard import RequestGuard, error
from opsd_rollout.serve.protocol import (CompletionChoice, CompletionRequest, CompletionResponse, ModelCard,
                                         ModelList, TokenizeRequest, TokenizeResponse, UsageInfo)

OPEN_PATHS = ("/health", )
"""Paths answered without the key: a load balancer's probe carries none (vLLM leaves /health open too)."""


def request_bytes_limit(max_batch_tokens: int) -> int:
    """The largest body taken: ``max_batch_tokens`` token ids of up to 7 digits and a separator each, and room for
    the other fields (a larger body could not be a request the engine runs)."""
    return 8 * max_batch_tokens + (64 << 10)


def build_app(engine: TeacherEngine, tokenizer: Any, *, model_name: str, api_key: str | None = None,
              compact_answers: bool = True, read_timeout_s: float = 30.0) -> FastAPI:
    """The app serving ``engine``'s teacher as ``model_name``; with ``compact_answers``, the compact answer to a
    client that asks for it (``opsd_rollout.compact_answer``), else vLLM's JSON to every client. A request's body
    must arrive within ``read_timeout_s`` of its head (``guard.RequestGuard``)."""
    app = FastAPI(title="opsd-rollout teacher", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(RequestGuard, max_bytes=request_bytes_limit(engine.limits.max_batch_tokens),
                       read_timeout_s=read_timeout_s, api_key=api_key, open_paths=OPEN_PATHS)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        return error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where or None)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail), "NotFoundError" if exc.status_code == 404 else "Error")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    card = ModelCard(id=model_name, root=model_name, max_model_len=engine.limits.max_model_len,
                     vocab_size=engine.vocab_size, max_logprobs=engine.limits.max_logprobs,
                     compact_answer_version=compact_answer.VERSION if compact_answers else None)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card])

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Any:
        if body.model not in (None, model_name):
            return error(404, f"the model {body.model!r} is not served here (only {model_name!r})", "NotFoundError",
                         "model")
        tokens = list(tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
        return TokenizeResponse(count=len(tokens), max_model_len=engine.limits.max_model_len, tokens=tokens)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        if body.model not in (None, model_name):
            return error(404, f"the model {body.model!r} is not served here (only {model_name!r})", "NotFoundError",
                         "model")
        if body.stream:
            return error(400, "stream: prompt_logprobs are not streamed (as in vLLM)", param="stream")
        rows = body.rows()
        if any(len(row) == 0 for row in rows):
            return error(400, "prompt: an empty prompt has nothing to score", param="prompt")
        try:
            compact = compact_answers and _compact_asked(request.headers.get("accept", ""))
            starts = _compact_request(body, rows) if compact else _json_request(body)
        except Refused as refused:
            return error(refused.status, refused.args[0], "NotAcceptableError" if refused.status == 406 else
                         "BadRequestError", refused.param)
        k = body.prompt_logprobs or 0
        try:
            future = engine.submit(rows, k, starts, ranks=not compact)
        except LimitExceeded as refused:
            kind = "RateLimitError" if refused.status == 429 else "BadRequestError"
            return error(refused.status, refused.args[0], kind, refused.limit)
        scores = await asyncio.wrap_future(future)
        try:
            _check_scores(scores, k)
        except ValueError as broken:  # the teacher's own fault: nothing a client could read as log-probabilities
            return error(500, str(broken), "InternalServerError")
        if compact:
            return Response(_packed(rows, scores, k, body.prompt_logprobs_dtype),
                            media_type=compact_answer.content_type())
        tokens = sum(len(row) for row in rows)
        # the response's envelope from its model, the per-position entries as plain data: validating thousands of
        # Logprob objects per request would take the server longer than the teacher's forward
        envelope = CompletionResponse(model=model_name, choices=[], usage=UsageInfo(prompt_tokens=tokens,
                                                                                     total_tokens=tokens))
        document = envelope.model_dump()
        document["choices"] = [
            dict(CompletionChoice(index=index, prompt_token_ids=row if body.return_token_ids else None).model_dump(),
                 prompt_logprobs=_prompt_logprobs(row, answer, k) if body.prompt_logprobs is not None else None)
            for index, (row, answer) in enumerate(zip(rows, scores))]
        return Response(json.dumps(document, allow_nan=False), media_type="application/json")

    return app


class Refused(ValueError):
    """A request refused before it is queued: ``status`` to answer with, ``param`` the field (or header) at fault."""

    def __init__(self, message: str, param: str, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def _json_request(body: CompletionRequest) -> None:
    """vLLM's answer: every position; our compact answer's fields have no meaning in it."""
    if body.prompt_logprobs_start is not None:
        raise Refused("prompt_logprobs_start: read with the compact answer only (Accept: "
                      f"{compact_answer.content_type()})", "prompt_logprobs_start")
    return None


def _compact_asked(accept: str) -> bool:
    """Whether the request asks for the compact answer; a version other than this server's is refused (406) in one
    line naming both."""
    try:
        version = compact_answer.asked_version(accept)
    except ValueError as unread:
        raise Refused(str(unread), "accept", 406) from None
    if version is not None and version != compact_answer.VERSION:
        raise Refused(f"this server gives the compact answer version {compact_answer.VERSION}, and the client asked "
                      f"for version {version}: run the same opsd-rollout release on both sides (or serve-teacher "
                      "--no-compact-answers for vLLM's JSON)", "accept", 406)
    return version is not None


def _compact_request(body: CompletionRequest, rows: list[list[int]]) -> list[int]:
    """The first position answered per row."""
    starts = body.prompt_logprobs_start or [1] * len(rows)
    if len(starts) != len(rows):
        raise Refused(f"prompt_logprobs_start: {len(starts)} starts for {len(rows)} prompts", "prompt_logprobs_start")
    for index, (start, row) in enumerate(zip(starts, rows)):
        if start >= len(row):
            raise Refused(f"prompt_logprobs_start[{index}]: {start} is past prompt {index}'s last position "
                          f"{len(row) - 1}", "prompt_logprobs_start")
    return starts


def _check_scores(scores: list[RowScores], k: int) -> None:
    """The server's own check before it answers, the one its clients apply (``check_logprobs``)."""
    for index, answer in enumerate(scores):
        for values in (answer.token_logprobs, answer.top_logprobs[:, :k]):
            check_logprobs(values, lambda t, start=answer.start: f"prompt {index} position {start + t}")


def _packed(rows: list[list[int]], scores: list[RowScores], k: int, dtype: str) -> bytes:
    """The compact answer's body (``opsd_rollout.compact_answer``)."""
    counts = [len(answer.token_logprobs) for answer in scores]
    if k == 0:
        return compact_answer.pack(rows, counts, 0, dtype, torch.cat([a.token_logprobs for a in scores])[:, None],
                                   None)
    return compact_answer.pack(rows, counts, k, dtype, torch.cat([a.top_logprobs for a in scores]),
                               torch.cat([a.top_ids for a in scores]))


def _prompt_logprobs(row: list[int], answer: RowScores, k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` (``list[dict[int, Logprob] | None]`` as JSON): ``None`` for the first token, then
    per position the top k and the given token (its own rank, possibly past k)."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    top_ids, top_logprobs = answer.top_ids[:, :k].tolist(), answer.top_logprobs[:, :k].tolist()
    token_logprobs, ranks = answer.token_logprobs.tolist(), answer.ranks.tolist()
    for t in range(1, len(row)):
        entry = {str(token): {"logprob": value, "rank": rank + 1, "decoded_token": None}
                 for rank, (token, value) in enumerate(zip(top_ids[t - 1], top_logprobs[t - 1]))}
        entry.setdefault(str(row[t]), {"logprob": token_logprobs[t - 1], "rank": ranks[t - 1], "decoded_token": None})
        out.append(entry)
    return out
