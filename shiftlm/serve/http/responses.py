"""Engine outputs -> OpenAI response bodies and SSE chunks (completions and chat, n samples per prompt,
several prompts per request, logprobs and echo).

Choice `i` of a request with P prompts and n samples each belongs to prompt `i // n`, as OpenAI and
vLLM number them. With `echo`, a completion's text starts with its prompt and its logprobs start with
the prompt tokens' (the first has none: nothing predicts it); with `max_tokens=0` (lm-eval's
loglikelihood requests) the one token generated to get there is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from shiftlm.serve.engine.errors import EngineError
from shiftlm.serve.http.protocol import api_error
from shiftlm.serve.http.tools import merge_calls


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Choices:
    """The growing state of every choice of one request."""

    def __init__(
        self,
        prefix,
        body,
        params,
        prompts,
        texts,
        tokenizer,
        chat,
        echo=False,
        drop_output=False,
        tools=None,
        reasoning=None,
    ):
        """A chat's `tools` (tools.ToolChoice) and `reasoning` (prompt ids -> a reasoning.ThinkSplit)
        take each choice's text apart: thinking first, then tool calls in what follows it."""
        self.response_id, self.created, self.model = new_id(prefix), now(), body.model
        self.chat, self.echo, self.drop_output = chat, echo, drop_output
        self.n, self.prompts = params.n, prompts
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.want_logprobs = params.logprobs is not None
        count = len(prompts) * self.n
        self.text = [""] * count
        self.logprobs: list[list] = [[] for _ in range(count)]
        self.finish: list[str | None] = [None] * count
        self.stop_reason: list[int | str | None] = [None] * count  # vLLM's field
        self.tools = tools  # a chat's tools.ToolChoice: each choice's text goes through its parser
        self.calls = [tools.stream() for _ in range(count)] if tools is not None else None
        self.tool_calls: list[list[dict]] = [[] for _ in range(count)]  # `delta.tool_calls` items
        self.thinking = [reasoning(prompts[k // self.n]) for k in range(count)] if reasoning else None
        self.show_reasoning = getattr(body, "include_reasoning", True)  # vLLM's field
        self.reasoning = [""] * count
        self.tokens = [0] * count
        self.started = [False] * count
        self.offsets = [0] * count
        decode = functools.lru_cache(maxsize=65536)(lambda token: tokenizer.decode([token]))
        self.decode = decode
        self._echo_text = [
            (text if isinstance(text, str) else tokenizer.decode(ids)) if echo else ""
            for text, ids in zip(texts or prompts, prompts)
        ]

    @property
    def num_finished(self) -> int:
        return sum(reason is not None for reason in self.finish)

    def add(self, prompt_index: int, out, render: bool = True) -> dict[str, Any] | None:
        """Record one engine output; return its choice as a stream chunk shows it (if `render`)."""
        i = prompt_index * self.n + out.index
        first = not self.started[i]
        self.started[i] = True
        text = "" if self.drop_output else out.text
        entries: list = []
        if first and self.echo:
            text = self._echo_text[prompt_index] + text
            if out.prompt_logprobs is not None:
                entries += list(zip(self.prompts[prompt_index], out.prompt_logprobs))
        if self.want_logprobs and out.logprobs is not None and not self.drop_output:
            entries.append((out.logprobs.token_id, out.logprobs))
        finish, calls, reasoning = out.finish_reason, [], ""
        if self.thinking is not None:
            reasoning, text = self.thinking[i].feed(text)
            if finish is not None:
                more, rest = self.thinking[i].finish()
                reasoning, text = reasoning + more, text + rest
            reasoning = reasoning if self.show_reasoning else ""
            self.reasoning[i] += reasoning
        if self.calls is not None:
            text, calls = self.calls[i].feed(text)
            if finish is not None:
                rest, more = self.calls[i].finish()
                text, calls = text + rest, calls + more
                finish = self.tools.finish_reason(finish, self.calls[i].count > 0)
            self.tool_calls[i] += calls
        self.text[i] += text
        self.logprobs[i] += entries
        self.finish[i] = finish
        self.stop_reason[i] = out.stop_reason
        self.tokens[i] = 0 if self.drop_output else out.completion_tokens
        return self._choice(i, text, entries, finish, first, calls, reasoning) if render else None

    def _logprobs(self, i: int, entries: list) -> dict[str, Any] | None:
        if not entries and not (self.want_logprobs or self.echo):
            return None
        if self.chat:
            return chat_logprobs([entry for _, entry in entries if entry is not None], self.decode)
        body = completion_logprobs(entries, self.decode, self.offsets[i])
        self.offsets[i] += sum(len(token) for token in body["tokens"])
        return body

    def _choice(
        self, i: int, text: str, entries: list, finish: str | None, first: bool, calls: list, reasoning: str
    ) -> dict[str, Any]:
        logprobs = self._logprobs(i, entries) if (self.want_logprobs or entries) else None
        ended = {"finish_reason": finish, "stop_reason": self.stop_reason[i]}
        if self.chat:
            delta = {"content": text or (None if calls else ""), **({"role": "assistant"} if first else {})}
            if calls:
                delta["tool_calls"] = calls
            if reasoning:
                delta["reasoning_content"] = reasoning
            return {"index": i, "delta": delta, "logprobs": logprobs, **ended}
        return {"index": i, "text": text, "logprobs": logprobs, **ended}

    def usage(self) -> dict[str, int]:
        return usage(sum(len(p) for p in self.prompts), sum(self.tokens))

    def header(self, obj: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model}


def render_response(choices: Choices) -> dict[str, Any]:
    """The non-streaming body once every choice finished."""
    items = []
    for i, text in enumerate(choices.text):
        choices.offsets[i] = 0
        entries = choices.logprobs[i]
        logprobs = choices._logprobs(i, entries) if (choices.want_logprobs or entries) else None
        ended = {"finish_reason": choices.finish[i], "stop_reason": choices.stop_reason[i]}
        if choices.chat:
            message = {"role": "assistant", "content": text}
            if choices.tool_calls[i]:
                message.update(content=text or None, tool_calls=merge_calls(choices.tool_calls[i]))
            if choices.thinking is not None:
                message["reasoning_content"] = choices.reasoning[i] or None
            items.append({"index": i, "message": message, "logprobs": logprobs, **ended})
        else:
            items.append({"index": i, "text": text, "logprobs": logprobs, **ended})
    obj = "chat.completion" if choices.chat else "text_completion"
    return {**choices.header(obj), "choices": items, "usage": choices.usage()}


async def merged(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """(prompt index, output) from several request streams as they come; closing this closes them all."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator) -> None:
        try:
            async for out in stream:
                await queue.put((index, out))
            await queue.put((index, done))
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await queue.put((index, err))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def render_stream(outputs: AsyncIterator, choices: Choices) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if choices.chat else "text_completion"
    try:
        async for prompt_index, out in outputs:
            chunk = {**choices.header(obj), "choices": [choices.add(prompt_index, out)]}
            if choices.num_finished == len(choices.finish) and not choices.include_usage:
                chunk["usage"] = choices.usage()
            yield f"data: {json.dumps(chunk)}\n\n"
        if choices.include_usage:
            yield f"data: {json.dumps({**choices.header(obj), 'choices': [], 'usage': choices.usage()})}\n\n"
    except EngineError as err:
        yield f"data: {json.dumps(api_error(err).body())}\n\n"
    finally:
        await outputs.aclose()
    yield "data: [DONE]\n\n"


async def finished_unless_gone(request, work) -> bool:
    """Run the coroutine `work` to its end (re-raising its error); if the client disconnects first,
    cancel it and return False: the cancelled output iterators' finally blocks abort the requests.
    The disconnect is ASGI's `http.disconnect` message, seen as it arrives (as vLLM listens for it),
    not polled."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():  # the client left (or this handler was cancelled)
            task.cancel()
        gone.cancel()
    if not task.done() or task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await task  # its finally blocks (the aborts) run before the handler returns
        return False
    task.result()
    return True


async def _disconnected(request) -> None:
    """Returns when the client has gone: the request body is read, so the next ASGI message is the
    disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def completion_logprobs(entries: list, decode, offset: int = 0) -> dict[str, Any]:
    """The legacy completions `logprobs` object for a list of `TokenLogprob | (token_id, None)`;
    `offset` is the text offset of the first token."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, entry in entries:
        text = decode(token_id)
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
        token_logprobs.append(None if entry is None else entry.logprob)
        top_logprobs.append(None if entry is None else {decode(i): lp for i, lp in entry.top})
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def chat_logprobs(entries: list, decode) -> dict[str, Any]:
    """The chat `logprobs` object ({"content": [...]}) for a list of TokenLogprob."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

    return {
        "content": [
            {**item(entry.token_id, entry.logprob), "top_logprobs": [item(i, lp) for i, lp in entry.top]}
            for entry in entries
        ]
    }
