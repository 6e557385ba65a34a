"""The OpenAI-compatible HTTP API (FastAPI): completions, chat, models, health, Prometheus metrics.

    app = build_app(AsyncEngine(engine), tokenizer, model_name="tiny")
    uvicorn.run(app, host="127.0.0.1", port=8000)

Every request is validated before it reaches the engine, so a bad one gets its own error (400 bad
parameter, 404 unknown model, 413 prompt too long, 429 too many requests in flight, 503 engine down)
and never disturbs the others. Streams are Server-Sent Events ending in `data: [DONE]`; the last
chunk carries `usage` (or, with `stream_options.include_usage`, a final chunk with no choices does,
as OpenAI sends it).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from shiftlm.serve.async_engine import AsyncEngine, EngineDead, Overloaded
from shiftlm.serve.engine import PromptTooLong
from shiftlm.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingFields,
    new_id,
    now,
    usage,
)
from shiftlm.serve.sequence import InvalidRequest, SamplingParams
from shiftlm.serve.text import Tokenizer


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def build_app(
    engine: AsyncEngine, tokenizer: Tokenizer, model_name: str, default_max_tokens: int = 16
) -> FastAPI:
    app = FastAPI(title="shiftlm")

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, error: ApiError) -> JSONResponse:
        return _error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        return _error_response(
            ApiError(400, f"invalid request body: {where}: {first.get('msg')}", where or None)
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.error is not None:
            return _error_response(ApiError(503, f"the engine stopped: {engine.error!r}"))
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": model_name,
            "object": "model",
            "created": now(),
            "owned_by": "shiftlm",
            "max_model_len": engine.engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        scheduler = engine.engine.scheduler
        gauges = {
            "num_requests_running": ("Sequences in the running batch.", len(scheduler.running)),
            "num_requests_waiting": ("Sequences waiting to be scheduled.", len(scheduler.waiting)),
            "kv_cache_usage_ratio": ("Fraction of KV-cache blocks in use.", scheduler.blocks.allocator.usage),
        }
        counters = {
            "mode_switches": (
                "Steps whose parallel mode differs from the previous step's.",
                scheduler.stats.mode_switches,
            ),
            "preemptions": (
                "Sequences preempted (to be recomputed) for lack of KV blocks.",
                scheduler.stats.preemptions,
            ),
            "prefix_cache_hit_tokens": (
                "Prompt tokens whose K/V came from the prefix cache.",
                scheduler.blocks.prefix_hits,
            ),
        }
        counters.update(
            {
                f"steps_{mode}": (f"Engine steps run in {mode} mode.", count)
                for mode, count in scheduler.stats.steps_per_mode.items()
            }
        )
        return PlainTextResponse(
            engine.engine.metrics.render(gauges, counters), media_type="text/plain; version=0.0.4"
        )

    def admit(body: _SamplingFields, prompt_ids: list[int], default_tokens: int) -> SamplingParams:
        if body.model != model_name:
            raise ApiError(
                404, f"model {body.model!r} does not exist; this server serves {model_name!r}", "model"
            )
        params = body.sampling_params(default_tokens)
        try:
            engine.check(prompt_ids, params)
        except PromptTooLong as err:
            raise ApiError(413, str(err), err.param) from None
        except InvalidRequest as err:
            raise ApiError(400, str(err), err.param) from None
        except (Overloaded, EngineDead) as err:
            with engine.engine.metrics.lock:
                engine.engine.metrics.rejected_requests += 1
            raise ApiError(429 if isinstance(err, Overloaded) else 503, str(err)) from None
        return params

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        prompt_ids = body.prompt if isinstance(body.prompt, list) else tokenizer.encode(body.prompt)
        params = admit(body, prompt_ids, default_max_tokens)
        return await _respond(engine, body, prompt_ids, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, f"model {model_name!r} has no chat template; use /v1/completions", "messages")
        messages = [message.model_dump() for message in body.messages]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        params = admit(body, prompt_ids, max(1, engine.engine.max_model_len - len(prompt_ids) - 1))
        return await _respond(engine, body, prompt_ids, params, chat=True)

    return app


async def _respond(
    engine: AsyncEngine, body: _SamplingFields, prompt_ids: list[int], params: SamplingParams, chat: bool
):
    response_id = new_id("chatcmpl" if chat else "cmpl")
    header = {"id": response_id, "created": now(), "model": body.model}
    outputs = engine.generate(prompt_ids, params)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(outputs, header, chat, params.n, include_usage), media_type="text/event-stream"
        )
    texts, reasons, tokens = [""] * params.n, [None] * params.n, [0] * params.n
    try:
        async for out in outputs:
            texts[out.index] += out.text
            reasons[out.index] = out.finish_reason
            tokens[out.index] = out.completion_tokens
    except EngineDead as err:
        raise ApiError(503, str(err)) from None
    if chat:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": texts[i]},
                "logprobs": None,
                "finish_reason": reasons[i],
            }
            for i in range(params.n)
        ]
    else:
        choices = [
            {"index": i, "text": texts[i], "logprobs": None, "finish_reason": reasons[i]}
            for i in range(params.n)
        ]
    obj = "chat.completion" if chat else "text_completion"
    return {**header, "object": obj, "choices": choices, "usage": usage(len(prompt_ids), sum(tokens))}


async def _sse(
    outputs: AsyncIterator, header: dict, chat: bool, n: int, include_usage: bool
) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    tokens, finished, started = [0] * n, 0, set()
    prompt_tokens = 0
    try:
        async for out in outputs:
            tokens[out.index] = out.completion_tokens
            prompt_tokens = out.prompt_tokens
            finished += out.finish_reason is not None
            if chat:
                delta = {"content": out.text}
                if out.index not in started:
                    delta["role"] = "assistant"
                    started.add(out.index)
                choice = {
                    "index": out.index,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": out.finish_reason,
                }
            else:
                choice = {
                    "index": out.index,
                    "text": out.text,
                    "logprobs": None,
                    "finish_reason": out.finish_reason,
                }
            chunk = {**header, "object": obj, "choices": [choice]}
            if finished == n and not include_usage:
                chunk["usage"] = usage(prompt_tokens, sum(tokens))
            yield f"data: {json.dumps(chunk)}\n\n"
        if include_usage:
            yield f"data: {json.dumps({**header, 'object': obj, 'choices': [], 'usage': usage(prompt_tokens, sum(tokens))})}\n\n"
    except EngineDead as err:
        yield f"data: {json.dumps(ApiError(503, str(err)).body())}\n\n"
    yield "data: [DONE]\n\n"
