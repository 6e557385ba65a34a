"""The OpenAI-compatible HTTP API (FastAPI): completions, chat, models, health, Prometheus metrics.

    app = build_app(AsyncEngine(engine), tokenizer, ApiOptions(model_name="tiny"))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Every request is validated before it reaches the engine, so a bad one gets its own OpenAI-shaped
error (400 bad parameter, unimplemented field, or a prompt or max_tokens past the context, as vLLM
answers them; 401 API key; 404 unknown model or route; 408 a body that stalls; 413 body over
--max-request-bytes; 429 too many requests in flight and 503 engine down, both with Retry-After; 500
its step failed) and never disturbs the others. Text is tokenized on a worker thread, after a length
check that needs no tokenizer (a chat's counts its messages too, and its rendered template), so a
10 MB prompt neither blocks `/health` nor costs gigabytes. A non-streaming request
whose client disconnects is aborted, as a stream is. Streams are Server-Sent Events ending in
`data: [DONE]`; the last chunk carries `usage` (or, with `stream_options.include_usage`, a final
chunk with no choices does, as OpenAI sends it).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from shiftlm.serve.engine.async_engine import AsyncEngine
from shiftlm.serve.engine.errors import EngineError
from shiftlm.serve.engine.structured import StructuredOutputsParams
from shiftlm.serve.engine.text import Tokenizer
from shiftlm.serve.engine.tokenizer import (
    chat_messages,
    choose_chat_template,
    opens_thinking,
    render_chat,
    think_tokens,
)
from shiftlm.serve.http.middleware import GuardMiddleware, add_error_handlers
from shiftlm.serve.http.protocol import (
    RETRY_AFTER_BUSY,
    RETRY_AFTER_DOWN,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    NamedToolChoice,
    SamplingFields,
    TokenizeRequest,
    api_error,
)
from shiftlm.serve.http.reasoning import REASONING_PARSERS
from shiftlm.serve.http.responses import Choices, finished_unless_gone, merged, render_response, render_stream
from shiftlm.serve.http.streams_api import add_stream_routes
from shiftlm.serve.http.tools import ToolChoice

log = logging.getLogger("shiftlm.serve")


@dataclass(frozen=True)
class ApiOptions:
    model_name: str
    default_max_tokens: int = 16
    api_key: str | None = None
    max_request_bytes: int = 16 * 2**20
    chat_template: str | None = None  # overrides the tokenizer's own
    step_timeout: float | None = None  # /health is 503 while a step has run longer than half of it
    body_timeout: float = 30.0  # a body that stalls this long gets a 408 (middleware.py)
    # what finds tool calls in replies to tool_choice "auto" (tool_parsers.TOOL_CALL_PARSERS); None: "auto" is off
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None  # reasoning.REASONING_PARSERS: thinking -> reasoning_content
    # the model's generation_config.json values (serve/generation_config.py) of what a request leaves out
    sampling_defaults: tuple[tuple[str, float | int], ...] = ()


def max_chars_per_token(tokenizer) -> int:
    """The longest token's text: a prompt longer than max_model_len times this cannot fit, so it is
    refused before tokenizing. Byte-level vocabularies spell one byte per character, an upper bound."""
    try:
        return max(8, max(len(token) for token in tokenizer.get_vocab()))
    except (AttributeError, TypeError, ValueError):
        return 64


def build_app(engine: AsyncEngine, tokenizer: Tokenizer, options: ApiOptions) -> FastAPI:
    app = FastAPI(title="shiftlm")
    model_name = options.model_name
    max_chars = engine.max_model_len * max_chars_per_token(tokenizer)
    tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shiftlm-tokenize")
    thinking = None
    if options.reasoning_parser:
        parser, think = REASONING_PARSERS[options.reasoning_parser], think_tokens(tokenizer)  # once

        def thinking(prompt_ids):  # a reply starts inside the thinking if its prompt left one open
            return parser(opens_thinking(prompt_ids, think))

    add_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.error is not None:
            raise ApiError(503, f"the engine stopped: {engine.error}", retry_after=RETRY_AFTER_DOWN)
        running = engine.step_running_for()
        if options.step_timeout is not None and running > options.step_timeout / 2:
            raise ApiError(
                503,
                f"the engine's current step has run {running:.1f} s (half of --step-timeout "
                f"{options.step_timeout:g} s): stalled or overloaded",
                retry_after=RETRY_AFTER_BUSY,
            )
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "shiftlm"}
        return {"object": "list", "data": [{**card, "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        from shiftlm.serve.engine.metrics import render_engine_metrics

        return PlainTextResponse(render_engine_metrics(engine), media_type="text/plain; version=0.0.4")

    def refuse_if_full(prompts: int) -> None:
        """A 429 (or 503) before tokenizing: refusals stay fast while a burst queues on the tokenizer."""
        try:
            engine.refuse_if_full(prompts)
        except EngineError as err:
            raise api_error(err) from None

    def check_size(size: int, param: str) -> None:
        if size > max_chars:  # a 400, as vLLM answers a prompt past the context (413: the body)
            raise ApiError(
                400,
                f"the {param} has {size} characters, more than the context of {engine.max_model_len} "
                "tokens can hold; shorten it",
                param,
            )

    async def tokenize(work, size: int, param: str) -> list[int]:
        check_size(size, param)
        try:
            return await asyncio.get_running_loop().run_in_executor(tokenize_pool, work)
        except ApiError:
            raise
        except EngineError as err:  # a request field the renderer refused (engine/tokenizer.render_chat)
            raise api_error(err) from None
        except UnicodeEncodeError:
            raise ApiError(400, f"the {param} is not valid Unicode (a lone surrogate?)", param) from None
        except Exception as err:  # noqa: BLE001 - the tokenizer's own error, as one line
            raise ApiError(400, f"the {param} could not be tokenized: {type(err).__name__}", param) from None

    add_stream_routes(
        app, engine, tokenizer, model_name, options.default_max_tokens, tokenize, options.sampling_defaults
    )

    async def check_grammar(
        body: SamplingFields, tools: ToolChoice | None = None
    ) -> StructuredOutputsParams | None:
        """The request's grammar (its tools', else its own), compiled off the event loop (a large
        schema takes a while); the engine's own check then finds it in its cache."""
        tool_spec = None
        try:
            spec = body.structured()
            tool_spec = tools.structured() if tools is not None else None
            if spec is not None and tool_spec is not None:
                raise ApiError(
                    400,
                    "a named or required tool_choice keeps the reply to the tool's arguments: send "
                    "response_format or structured_outputs without it",
                    "tool_choice",
                )
            spec = spec or tool_spec
            if spec is not None:
                await asyncio.get_running_loop().run_in_executor(tokenize_pool, engine.check_grammar, spec)
            return tool_spec
        except EngineError as err:
            if getattr(err, "param", None) == "structured_outputs":  # name what the client sent
                if tool_spec is not None:
                    err.param = "tools"
                elif body.structured_outputs is None:
                    err.param = "response_format"
            raise api_error(err) from None

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {model_name!r}", "model")

    def admit(
        body: SamplingFields,
        prompts: list[list[int]],
        default_tokens: int,
        logprobs,
        prompt_logprobs,
        structured=None,
        after_thinking=False,
    ):
        check_model(body.model)
        if (field := body.unsupported_field()) is not None:
            fix = "remove it from the request"
            if field.startswith("guided_"):  # vLLM's older spelling, removed there too
                fix = f"send structured_outputs: {{{field.removeprefix('guided_')!r}: ...}} instead"
            raise ApiError(400, f"{field!r} is not supported by shiftlm; {fix}", field)
        defaults = options.sampling_defaults
        if body.max_tokens is None:  # the default never asks for more than the context (or cache) has left
            default_tokens = dict(defaults).get("max_tokens", default_tokens)  # generation_config's
            default_tokens = min(default_tokens, engine.max_tokens_left(max(map(len, prompts)), body.n))
        try:
            params = body.sampling_params(
                default_tokens,
                logprobs,
                prompt_logprobs,
                engine.vocab_size,
                structured,
                after_thinking,
                defaults,
            )
            return params, engine.submit(prompts, params)
        except EngineError as err:
            raise api_error(err) from None

    async def run(request: Request, body: SamplingFields, streams, choices: Choices):
        if body.stream:
            return StreamingResponse(render_stream(merged(streams), choices), media_type="text/event-stream")
        if not await finished_unless_gone(request, _consume(merged(streams), choices)):
            log.info("client of %s went away; aborted", choices.response_id)
            return JSONResponse({}, status_code=499)
        return render_response(choices)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        max_tokens_zero = body.max_tokens == 0
        if max_tokens_zero and not body.echo:
            raise ApiError(400, "max_tokens must be >= 1 (0 is allowed only with echo)", "max_tokens")
        if max_tokens_zero:  # lm-eval's loglikelihood: score the prompt, generate nothing
            body.max_tokens, body.min_tokens = 1, 0
        texts = body.prompts()
        if not texts:
            raise ApiError(400, "the prompt list is empty", "prompt")
        refuse_if_full(len(texts))
        prompts = []
        for text in texts:
            if isinstance(text, str):
                prompts.append(await tokenize(lambda t=text: tokenizer.encode(_utf8(t)), len(text), "prompt"))
            else:
                prompts.append(list(text))
        logprobs = body.logprobs
        prompt_logprobs = logprobs if body.echo and logprobs is not None else None
        await check_grammar(body)
        params, streams = admit(body, prompts, options.default_max_tokens, logprobs, prompt_logprobs)
        choices = Choices(
            "cmpl",
            body,
            params,
            prompts,
            texts,
            tokenizer,
            chat=False,
            echo=body.echo,
            drop_output=max_tokens_zero,
        )
        return await run(request, body, streams, choices)

    async def chat_prompt(
        body: ChatCompletionRequest | TokenizeRequest, add_special_tokens=False
    ) -> list[int]:
        """The token ids of a conversation as the chat template renders it."""
        template = choose_chat_template(tokenizer, options.chat_template)
        if not template:
            raise ApiError(
                400,
                f"model {model_name!r} has no chat template; use /v1/completions or --chat-template",
                "messages",
            )
        if len(body.messages) > engine.max_model_len:  # every message renders at least one token
            raise ApiError(
                400,
                f"{len(body.messages)} messages cannot fit the context of {engine.max_model_len} tokens",
                "messages",
            )
        try:
            messages = chat_messages([m.model_dump(exclude_none=True) for m in body.messages])
        except EngineError as err:
            raise api_error(err) from None
        for message in messages:
            _utf8(message["content"], "messages")
        tools = body.tool_dicts()

        def render() -> list[int]:
            text = render_chat(
                tokenizer,
                messages,
                template,
                body.add_generation_prompt,
                body.continue_final_message,
                body.chat_template_kwargs,
                tools,
            )
            check_size(len(text), "messages")  # the rendered template, before tokenizing it
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)

        size = sum(len(m["content"]) for m in messages) + len(messages)
        return await tokenize(render, size, "messages")

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's: a prompt's (or a conversation's) token ids, with the context they must fit."""
        check_model(body.model)
        if body.messages is not None and body.prompt is not None:
            raise ApiError(400, "send a prompt or messages, not both", "messages")
        if body.messages is not None:
            special = bool(body.add_special_tokens)  # vLLM's default for a conversation: the template's own
            ids = await chat_prompt(body, special)
        elif body.prompt is not None:
            special = body.add_special_tokens is not False
            text = _utf8(body.prompt)
            ids = await tokenize(
                lambda: tokenizer.encode(text, add_special_tokens=special), len(text), "prompt"
            )
        else:
            raise ApiError(400, "send a prompt or messages", "prompt")
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's: the text of token ids."""
        check_model(body.model)
        if len(body.tokens) > engine.max_model_len:
            raise ApiError(
                400, f"{len(body.tokens)} tokens: more than the context of {engine.max_model_len}", "tokens"
            )
        if not all(0 <= token < engine.vocab_size for token in body.tokens):
            raise ApiError(400, f"token ids must be in [0, {engine.vocab_size})", "tokens")
        return {"prompt": await tokenize(lambda: tokenizer.decode(body.tokens), 0, "tokens")}

    def tool_choice(body: ChatCompletionRequest) -> ToolChoice | None:
        choice = body.tool_choice
        if isinstance(choice, NamedToolChoice):
            choice = choice.model_dump()
        try:
            return ToolChoice.of(
                body.tool_dicts(), choice, options.tool_call_parser, body.parallel_tool_calls
            )
        except EngineError as err:
            raise api_error(err) from None

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        refuse_if_full(1)
        tools = tool_choice(body)
        prompt_ids = await chat_prompt(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        default = max(1, engine.max_model_len - len(prompt_ids) - 1)
        structured = await check_grammar(body, tools)
        if tools is not None:
            body.skip_special_tokens = tools.skip_special_tokens(body.skip_special_tokens)
        # with a reasoning parser a grammar holds the answer, after the thinking (as vLLM)
        params, streams = admit(body, [prompt_ids], default, logprobs, None, structured, thinking is not None)
        choices = Choices(
            "chatcmpl",
            body,
            params,
            [prompt_ids],
            [prompt_ids],
            tokenizer,
            chat=True,
            tools=tools,
            reasoning=thinking,
        )
        return await run(request, body, streams, choices)

    return GuardMiddleware(app, options.max_request_bytes, options.api_key, options.body_timeout)


def _utf8(text: str, param: str = "prompt") -> str:
    """`text` if it is valid Unicode; JSON can carry lone surrogates ("\\ud800"), which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(
            400, "the text contains a lone surrogate (invalid Unicode); send valid UTF-8 text", "prompt"
        ) from None
    return text


async def _consume(outputs, choices: Choices) -> None:
    try:
        async for prompt_index, out in outputs:
            choices.add(prompt_index, out, render=False)
    except EngineError as err:
        raise api_error(err) from None
