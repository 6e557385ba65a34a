"""ASGI guards in front of the API: a request-body size limit, a body read timeout and vLLM's
`--api-key`.

All answer with OpenAI-shaped JSON errors before FastAPI reads or parses anything: a body over the
limit is refused from its Content-Length, or, when chunked, as soon as the bytes received pass the limit
(so a 50 MB body never sits in memory); a body that stalls for `body_timeout` seconds gets a 408 and
its connection is closed. With an API key, every `/v1/*` route and the API's own description (`/docs`,
`/redoc`, `/openapi.json`) need `Authorization: Bearer KEY` (401 otherwise), as vLLM guards `/v1`;
`/health` and `/metrics` stay open for probes.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from shiftlm.serve.http.protocol import ApiError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


async def send_error(
    send: Send, status: int, message: str, error_type: str, param: str | None = None
) -> None:
    body = json.dumps({"error": {"message": message, "type": error_type, "param": param, "code": status}})
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body.encode()})


class BodyTooLarge(ApiError):
    """Raised from `receive`: the middleware answers 413 (or 408: `BodyTimeout`)."""


class BodyTimeout(BodyTooLarge):
    pass


GUARDED_PREFIXES = ("/v1", "/docs", "/redoc", "/openapi.json")


class GuardMiddleware:
    """Body-size limit, body read timeout and bearer-token check for an ASGI app."""

    def __init__(self, app, max_body_bytes: int, api_key: str | None = None, body_timeout: float = 30.0):
        self.app, self.max_body_bytes, self.api_key = app, max_body_bytes, api_key
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.api_key and scope["path"].startswith(GUARDED_PREFIXES):
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                await send_error(
                    send,
                    401,
                    "missing or wrong API key (send Authorization: Bearer KEY)",
                    "invalid_request_error",
                )
                return
        length = headers.get(b"content-length")
        limit_message = f"the request body is larger than the server's limit of {self.max_body_bytes} bytes (--max-request-bytes)"
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await send_error(send, 413, limit_message, "invalid_request_error")
            return
        received = 0
        started = False
        body_done = False

        async def limited_receive() -> dict[str, Any]:
            nonlocal received, body_done
            if body_done:  # after the body only the disconnect comes: no timeout on waiting for it
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout)
            except asyncio.TimeoutError:
                raise BodyTimeout(
                    408, f"the request body did not arrive within {self.body_timeout:g} s (--body-timeout)"
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.max_body_bytes:
                    raise BodyTooLarge(413, limit_message)
            return message

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            started |= message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge as err:
            if not started:
                await send_error(send, err.status, err.message, ApiError.TYPES[err.status])
