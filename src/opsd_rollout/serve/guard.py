"""What the teacher server takes from a client before a route runs, so that a request too large, too slow or without
the key costs it a bounded amount of memory and time, and good requests are answered meanwhile:

- ``RequestGuard`` (an ASGI middleware): a body over ``max_bytes`` is refused with 413, at once by its
  ``Content-Length`` or as it arrives when it comes in chunks without one (never held whole); a request without the
  key (every path but ``/health``) with 401 before its body is read; a body not all arrived ``read_timeout_s`` after
  its request's head with 408, the connection closed. What passes is handed to the app with its body read whole.
- ``TimedH11Protocol`` (uvicorn's h11 protocol): a connection that has not sent a whole request head
  ``read_timeout_s`` after it opened or after its last answer is closed (uvicorn's own ``timeout_keep_alive`` stops
  at a kept-alive connection's first byte: half a head would hold it for ever).

How many connections at once is uvicorn's ``limit_concurrency`` (503 past it), how long a head may be h11's
``max_incomplete_event_size`` (400 past it); errors are vLLM's JSON body (``error``).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from opsd_rollout.serve.protocol import ErrorInfo, ErrorResponse

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def error(status: int, message: str, kind: str = "BadRequestError", param: str | None = None,
          close: bool = False) -> JSONResponse:
    """vLLM's error body with ``status``; ``close``: the connection closed after it (a client whose request was
    not read whole)."""
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status, headers={"Connection": "close"} if close else None)


class Refused(Exception):
    def __init__(self, response: JSONResponse | None):
        super().__init__()
        self.response = response
        """What to answer; ``None``: the client went away, nothing to answer."""


class RequestGuard:
    """An ASGI middleware in front of the app: ``max_bytes`` a body, ``read_timeout_s`` for it to arrive, ``api_key``
    (``None``: none asked) on every path but ``open_paths``."""

    def __init__(self, app: Any, *, max_bytes: int, read_timeout_s: float, api_key: str | None,
                 open_paths: tuple[str, ...]):
        self.app, self.max_bytes, self.read_timeout_s = app, max_bytes, read_timeout_s
        self.key = None if api_key is None else f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            self.check_head(scope)
            body = await asyncio.wait_for(self.read_body(receive), self.read_timeout_s)
        except Refused as refused:
            if refused.response is not None:
                await refused.response(scope, receive, send)
            return None
        except asyncio.TimeoutError:
            await error(408, f"the request's body did not arrive within {self.read_timeout_s:g} s (serve-teacher "
                             "--read-timeout)", "RequestTimeoutError", "body", close=True)(scope, receive, send)
            return None
        return await self.app(scope, replay(body, receive), send)

    def check_head(self, scope: Scope) -> None:
        headers = dict(scope["headers"])
        size = headers.get(b"content-length", b"0")
        if size.isdigit() and int(size) > self.max_bytes:
            raise Refused(self.too_large(f"{int(size):,} bytes"))
        if self.key is not None and scope["path"] not in self.open_paths:
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.key):
                raise Refused(error(401, "this teacher wants 'Authorization: Bearer <key>' with the server's "
                                         "--api-key", "AuthenticationError"))

    def too_large(self, size: str) -> JSONResponse:
        return error(413, f"the request's body is {size}, over max_request_bytes {self.max_bytes:,} (what "
                          "--max-batch-tokens token ids take as JSON)", param="body", close=True)

    async def read_body(self, receive: Receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise Refused(None)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise Refused(self.too_large(f"over {size - len(chunk):,} bytes and still coming"))
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands over ``body`` whole first, then the client's own (a disconnect)."""
    given = False

    async def replayed() -> dict[str, Any]:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a connection closed when it has sent no whole request head ``read_timeout_s``
    after it opened or after its last answer (a request in progress is the ``RequestGuard``'s to time)."""

    def __init__(self, *args: Any, read_timeout_s: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.read_timeout_s = read_timeout_s
        self.head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        super().connection_lost(exc)

    def arm(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        self.head_timer = self.loop.call_later(self.read_timeout_s, self.no_head)

    def no_head(self) -> None:
        self.head_timer = None
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            self.transport.close()


def timed_h11(read_timeout_s: float) -> Callable[..., TimedH11Protocol]:
    """What uvicorn's ``http`` setting takes: the protocol, made with ``read_timeout_s``."""
    return functools.partial(TimedH11Protocol, read_timeout_s=read_timeout_s)
