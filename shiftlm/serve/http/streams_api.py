"""`POST /v1/streams`: one prompt, K streams generated in parallel over one shared KV cache
(serve/engine/streams.py), as JSON or as Server-Sent Events whose every event names its stream.

    {"model": "m", "prompt": "text" | [ids], "layout": "isolated" | "timestep" | "hogwild",
     "streams": [{"prefix": "text" | [ids], "max_tokens": 8, "stop": ["."], "temperature": 0, "seed": 1}],
     "max_tokens": 16, "temperature": 0.7, "stream": false}
    -> {"id", "object": "streams", "created", "model", "layout",
        "streams": [{"index", "text", "token_ids", "finish_reason"}], "usage"}

Request-level sampling fields are every stream's defaults; a stream may override `max_tokens`,
`stop`, `temperature` and `seed` (without its own seed, stream k of a seeded request uses seed + k, as
OpenAI's n samples do). Any other per-stream field is refused with a 400 naming it.
"""

from __future__ import annotations

import json
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from shiftlm.serve.engine.errors import EngineError, InvalidRequest
from shiftlm.serve.engine.sampling import SEED_MODULUS
from shiftlm.serve.http.protocol import ApiError, SamplingFields, api_error
from shiftlm.serve.http.responses import finished_unless_gone, new_id, now, usage


class StreamSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prefix: str | list[int] = ""
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    seed: int | None = None


class StreamsRequest(SamplingFields):
    prompt: str | list[int]
    streams: list[StreamSpec]
    layout: str = "timestep"

    def stream_params(self, default_max_tokens: int, vocab_size: int | None = None, defaults=()) -> list:
        if self.n != 1:
            raise InvalidRequest("n is not a /v1/streams field; send one entry per stream in streams", "n")
        for name in ("response_format", "structured_outputs"):
            if getattr(self, name) is not None:
                raise InvalidRequest(f"{name} is not a /v1/streams field (use /v1/completions)", name)
        base = self.sampling_params(default_max_tokens, None, None, vocab_size, defaults=defaults)
        params = []
        for k, spec in enumerate(self.streams):
            changes = {}
            if spec.max_tokens is not None:
                changes["max_tokens"] = spec.max_tokens
            if spec.temperature is not None:
                changes["temperature"] = spec.temperature
            if spec.stop is not None:
                changes["stop"] = (spec.stop,) if isinstance(spec.stop, str) else tuple(spec.stop)
            if spec.seed is not None:
                changes["seed"] = spec.seed % SEED_MODULUS
            elif base.seed is not None:
                changes["seed"] = (base.seed + k) % SEED_MODULUS
            params.append(replace(base, **changes))
        return params


def add_stream_routes(
    app, engine, tokenizer, model_name: str, default_max_tokens: int, tokenize, defaults=()
) -> None:
    """Register /v1/streams on `app`; `tokenize(work, size, param)` is the API's tokenizer call."""

    async def ids(value: str | list[int], param: str, special: bool) -> list[int]:
        if not isinstance(value, str):
            return list(value)
        if not value:
            return []
        return await tokenize(lambda: tokenizer.encode(value, add_special_tokens=special), len(value), param)

    @app.post("/v1/streams")
    async def streams(request: Request, body: StreamsRequest):
        if body.model != model_name:
            raise ApiError(
                404, f"model {body.model!r} does not exist; this server serves {model_name!r}", "model"
            )
        if (field := body.unsupported_field()) is not None:
            raise ApiError(
                400, f"{field!r} is not supported by /v1/streams; remove it from the request", field
            )
        try:
            engine.refuse_if_full(1)  # before tokenizing: refusals stay fast under a burst
        except EngineError as err:
            raise api_error(err) from None
        prompt = await ids(body.prompt, "prompt", True)
        prefixes = [
            await ids(spec.prefix, f"streams[{k}].prefix", False) for k, spec in enumerate(body.streams)
        ]
        try:
            params = body.stream_params(default_max_tokens, engine.vocab_size, defaults)
            outputs = engine.submit_streams(prompt, prefixes, params, body.layout)
        except EngineError as err:
            raise api_error(err) from None
        result = StreamsResult(body, prompt, prefixes)
        if body.stream:
            return StreamingResponse(result.events(outputs), media_type="text/event-stream")
        if not await finished_unless_gone(request, result.collect(outputs)):
            return JSONResponse({}, status_code=499)
        return JSONResponse(result.body())


class StreamsResult:
    """Every stream's text, tokens and finish reason as outputs arrive."""

    def __init__(self, body: StreamsRequest, prompt: list[int], prefixes: list[list[int]]):
        self.id, self.created, self.model, self.layout = new_id("strm"), now(), body.model, body.layout
        self.prompt_tokens = len(prompt) + sum(len(p) for p in prefixes)
        count = len(prefixes)
        self.text, self.tokens = [""] * count, [[] for _ in range(count)]
        self.finish: list[str | None] = [None] * count

    def add(self, out) -> dict:
        self.text[out.index] += out.text
        self.tokens[out.index] += out.token_ids
        self.finish[out.index] = out.finish_reason
        return {
            "index": out.index,
            "text": out.text,
            "token_ids": out.token_ids,
            "finish_reason": out.finish_reason,
        }

    async def collect(self, outputs) -> None:
        try:
            async for out in outputs:
                self.add(out)
        except EngineError as err:
            raise api_error(err) from None

    def _head(self, kind: str) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "layout": self.layout,
        }

    def _usage(self) -> dict:
        return usage(self.prompt_tokens, sum(len(t) for t in self.tokens))

    def body(self) -> dict:
        streams = [
            {"index": k, "text": text, "token_ids": tokens, "finish_reason": reason}
            for k, (text, tokens, reason) in enumerate(zip(self.text, self.tokens, self.finish))
        ]
        return {**self._head("streams"), "streams": streams, "usage": self._usage()}

    async def events(self, outputs):
        """SSE: one event per generated token, naming its stream; the last carries usage; [DONE]."""
        try:
            async for out in outputs:
                yield f"data: {json.dumps({**self._head('streams.chunk'), 'streams': [self.add(out)]})}\n\n"
            yield f"data: {json.dumps({**self._head('streams.chunk'), 'streams': [], 'usage': self._usage()})}\n\n"
        except EngineError as err:
            yield f"data: {json.dumps({'error': {'message': str(err), 'type': 'server_error'}})}\n\n"
        yield "data: [DONE]\n\n"
