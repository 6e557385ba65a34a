"""ASGI guards in front of the API: a request-body size limit, a body read timeout and vLLM's
`--api-key`.

All answer with OpenAI-shaped JSON errors before FastAPI reads or parses anything: a body over the
limit is refused from its Content-Length, or, when chunked, as soon as the bytes received pass the limit
(so a 50 MB body never sits in memory); a body that stalls for `body_timeout` seconds gets a 408 and
its connection is closed. With an API key, every `/v1/*` route and the API's own description (`/docs`,
`/redoc`, `/openapi.json`) need `Authorization: Bearer KEY` (401 otherwise), as vLLM guards `/v1`;
`/health` and `/metrics` stay open for probes. Behind them, `add_error_handlers` gives every error
FastAPI meets (a bad body, an unknown route, an unexpected exception) the same JSON shape.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from shiftlm.serve.http.protocol import ApiError

log = logging.getLogger("shiftlm.serve")

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


def add_error_handlers(app: FastAPI) -> None:
    """OpenAI's `{"error": {...}}` body for every error: an `ApiError` as raised, an invalid body or
    unparsable JSON (400 naming the field), FastAPI's own HTTP errors (404, 405), a client that went
    away (499, no body), and anything unexpected (500, logged with its traceback)."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers())

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        if first.get("type") == "json_invalid":
            return await _api_error(
                _, ApiError(400, f"the request body is not valid JSON: {first.get('msg')}")
            )
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        message = (
            f"invalid request body: {where}: {first.get('msg')}"
            if where
            else f"invalid request body: {first.get('msg')}"
        )
        return await _api_error(_, ApiError(400, message, where or None))

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, error: HTTPException) -> JSONResponse:
        return await _api_error(_, ApiError(error.status_code, str(error.detail)))

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, error: ClientDisconnect) -> JSONResponse:
        return JSONResponse({}, status_code=499)  # the client (or a shutdown) closed the connection

    @app.exception_handler(Exception)
    async def _internal(request: Request, error: Exception) -> JSONResponse:
        log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=error)
        return await _api_error(request, ApiError(500, f"internal error: {type(error).__name__}"))
