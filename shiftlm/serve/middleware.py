"""ASGI guards in front of the API: a request-body size limit and vLLM's `--api-key`.

Both answer with OpenAI-shaped JSON errors before FastAPI reads or parses anything: a body over the
limit is refused from its Content-Length, or, when chunked, as soon as the bytes received pass the limit
(so a 50 MB body never sits in memory). With an API key, every `/v1/*` route needs
`Authorization: Bearer KEY` (401 otherwise), as vLLM does; `/health` and `/metrics` stay open for probes.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from shiftlm.serve.protocol import ApiError

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
    """Raised from `receive`: FastAPI's ApiError handler turns it into the 413 response."""


class GuardMiddleware:
    """Body-size limit and bearer-token check for an ASGI app."""

    def __init__(self, app, max_body_bytes: int, api_key: str | None = None):
        self.app, self.max_body_bytes, self.api_key = app, max_body_bytes, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.api_key and scope["path"].startswith("/v1"):
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

        async def limited_receive() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge(413, limit_message)
            return message

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            started |= message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await send_error(send, 413, limit_message, "invalid_request_error")
