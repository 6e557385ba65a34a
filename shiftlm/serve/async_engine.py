"""Runs the engine loop in one thread and hands its outputs to asyncio request handlers.

The HTTP side validates a request (so a bad one fails alone, before anything is queued), then posts it
to the engine thread, which owns the engine: it admits new requests and aborts between steps and
steps while there is work. Outputs go back to each request's asyncio queue with
`call_soon_threadsafe`. If a step raises, the engine is marked dead, every waiting request gets the
error and `/health` turns 503.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from shiftlm.serve.engine import Engine, RequestOutput
from shiftlm.serve.sequence import InvalidRequest, SamplingParams


class Overloaded(RuntimeError):
    """Too many requests in flight; the client should retry later (HTTP 429)."""


class EngineDead(RuntimeError):
    """The engine loop stopped after an error; the server cannot serve (HTTP 503)."""


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """Thread-safe front of an `Engine`: `generate()` yields outputs as the engine produces them."""

    def __init__(self, engine: Engine, max_pending: int = 512):
        self.engine = engine
        self.max_pending = max_pending
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        self._wake = threading.Event()
        self._stop = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="shiftlm-engine", daemon=True)
        self._thread.start()

    @property
    def num_pending(self) -> int:
        return len(self._sinks)

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest / PromptTooLong / Overloaded / EngineDead without queueing anything."""
        if self.error is not None:
            raise EngineDead(f"the engine stopped after an error: {self.error!r}; restart the server")
        self.engine.check_request(prompt_ids, params)
        if self.num_pending >= self.max_pending:
            raise Overloaded(
                f"{self.num_pending} requests are in flight (limit {self.max_pending}); retry later"
            )

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield every output of one request until all of its samples finish; abort it if cancelled."""
        self.check(prompt_ids, params)
        request_id = f"req-{next(self._ids)}"
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        self._sinks[request_id] = sink
        self._post(("add", request_id, prompt_ids, params))
        finished = 0
        try:
            while finished < params.n:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished += item.finish_reason is not None
                yield item
        finally:
            if self._sinks.pop(request_id, None) is not None and finished < params.n:
                self._post(("abort", request_id))

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _post(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None:
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, item)

    def _loop(self) -> None:
        while not self._stop:
            self._drain_commands()
            if not self.engine.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except BaseException as err:  # a broken runner must not hang every client
                self.error = err
                for request_id in list(self._sinks):
                    self._deliver(request_id, EngineDead(f"the engine failed: {err!r}"))
                return
            for output in outputs:
                self._deliver(output.request_id, output)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "abort":
                self.engine.abort(command[1])
                continue
            _, request_id, prompt_ids, params = command
            try:
                self.engine.add_request(request_id, prompt_ids, params)
            except (InvalidRequest, ValueError) as err:  # raced past check(); fail this request only
                self._deliver(request_id, err)
