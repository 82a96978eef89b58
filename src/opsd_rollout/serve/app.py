"""The HTTP app: a thin FastAPI layer over a ``TeacherEngine`` (validate, queue, await, answer), vLLM's routes and
shapes: ``GET /health``, ``GET /v1/models``, ``POST /tokenize``, ``POST /v1/completions`` (token-id prompts,
``prompt_logprobs``). With an API key, every route but ``/health`` wants ``Authorization: Bearer KEY`` (vLLM's
``--api-key``). Errors are vLLM's JSON body with the status: 400 a bad request (the field named), 401 no or a wrong
key, 404 another model, 413 a request over ``max_batch_tokens`` (or a body larger than such a request's), 429 the
queue full; the limit a request broke is named in the message."""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from opsd_rollout.serve.engine import LimitExceeded, RowScores, TeacherEngine
from opsd_rollout.serve.protocol import (CompletionChoice, CompletionRequest, CompletionResponse, ErrorInfo,
                                         ErrorResponse, ModelCard, ModelList, TokenizeRequest, TokenizeResponse,
                                         UsageInfo)

OPEN_PATHS = ("/health", )
"""Paths answered without the key: a load balancer's probe carries none (vLLM leaves /health open too)."""


def error(status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def request_bytes_limit(max_batch_tokens: int) -> int:
    """The largest body taken: ``max_batch_tokens`` token ids of up to 7 digits and a separator each, and room for
    the other fields (a larger body could not be a request the engine runs)."""
    return 8 * max_batch_tokens + (64 << 10)


def build_app(engine: TeacherEngine, tokenizer: Any, *, model_name: str, api_key: str | None = None) -> FastAPI:
    """The app serving ``engine``'s teacher as ``model_name``."""
    app = FastAPI(title="opsd-rollout teacher", docs_url=None, redoc_url=None, openapi_url=None)

    max_request_bytes = request_bytes_limit(engine.limits.max_batch_tokens)

    @app.middleware("http")
    async def bearer_key(request: Request, call_next):
        size = request.headers.get("content-length", "0")
        if size.isdigit() and int(size) > max_request_bytes:  # refused before the body is read
            return error(413, f"the request's body is {int(size):,} bytes, over max_request_bytes "
                         f"{max_request_bytes:,} (what --max-batch-tokens token ids take as JSON)", param="body")
        if api_key is not None and request.url.path not in OPEN_PATHS:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error(401, "this teacher wants 'Authorization: Bearer <key>' with the server's --api-key",
                             "AuthenticationError")
        return await call_next(request)

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
                     vocab_size=engine.vocab_size, max_logprobs=engine.limits.max_logprobs)

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
    async def completions(body: CompletionRequest) -> Any:
        if body.model not in (None, model_name):
            return error(404, f"the model {body.model!r} is not served here (only {model_name!r})", "NotFoundError",
                         "model")
        if body.stream:
            return error(400, "stream: prompt_logprobs are not streamed (as in vLLM)", param="stream")
        rows = body.rows()
        if any(len(row) == 0 for row in rows):
            return error(400, "prompt: an empty prompt has nothing to score", param="prompt")
        k = body.prompt_logprobs or 0
        try:
            future = engine.submit(rows, k)
        except LimitExceeded as refused:
            kind = "RateLimitError" if refused.status == 429 else "BadRequestError"
            return error(refused.status, refused.args[0], kind, refused.limit)
        scores = await asyncio.wrap_future(future)
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


def _prompt_logprobs(row: list[int], answer: RowScores, k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` (``list[dict[int, Logprob] | None]`` as JSON): ``None`` for the first token, then
    per position the top k and the given token (its own rank, possibly past k)."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for t in range(1, len(row)):
        entry = {str(token): {"logprob": value, "rank": rank + 1, "decoded_token": None}
                 for rank, (token, value) in enumerate(zip(answer.top_ids[t - 1][:k], answer.top_logprobs[t - 1][:k]))}
        entry.setdefault(str(row[t]), {"logprob": answer.token_logprobs[t - 1], "rank": answer.ranks[t - 1],
                                       "decoded_token": None})
        out.append(entry)
    return out
