"""Runs the engine loop in one thread and hands its outputs to asyncio request handlers.

`submit` is the boundary: it validates every prompt of a request once (so a bad one fails alone,
before anything is queued), then the request is posted to the engine thread, which owns the engine: it admits new requests and aborts between steps and
steps while there is work. Outputs go back to each request's asyncio queue with
`call_soon_threadsafe`.

Failures, by where they happen (issue 13.1/13.2):
- An exception in a step on rank 0 alone (sampling, detokenization, a one-rank forward): the requests
  of that step get a 500 `StepFailed`, logged with their ids and the traceback; the engine goes on.
- An exception from the model runner when the model spans several ranks: the ranks may now disagree
  on which collective comes next, so nothing can run safely. The engine is marked dead (`fail()`):
  every request gets a 503 naming the failure, `/health` turns 503 and `on_fatal` (the server) exits
  the process non-zero for its supervisor to restart it.
- A step that does not return (a stalled or dead rank blocks a collective): the server's rank monitor
  sees `step_running_for()` pass its bound, or a rank's heartbeat stop, and calls `fail()`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import traceback
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from shiftlm.serve.engine.core import Engine, EngineStats, RequestOutput
from shiftlm.serve.engine.errors import EngineDead, InvalidRequest, Overloaded, StepError, StepFailed
from shiftlm.serve.engine.sequence import SamplingParams

log = logging.getLogger("shiftlm.serve")


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """Thread-safe front of an `Engine`: `generate()` yields outputs as the engine produces them."""

    def __init__(
        self,
        engine: Engine,
        max_pending: int = 512,
        multi_rank: bool = False,
        on_fatal: Callable[[str], None] | None = None,
        diagnose: Callable[[], str | None] | None = None,
    ):
        self.engine = engine
        self.max_pending = max_pending
        self.multi_rank = multi_rank  # a runner exception then desynchronizes the ranks: fatal
        self.on_fatal = on_fatal
        self.error: str | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # admitted requests: what --max-pending counts
        self._admission = threading.Lock()  # the count and the admission are one step
        self._wake = threading.Event()
        self._stop = False
        self._ids = itertools.count()
        self._step_started: float | None = None
        self.failed_steps = 0
        self.failed_requests = 0  # requests failed alone while sampling or detokenizing
        self._aborted: set[str] = set()
        self.diagnose = diagnose  # names a failed rank (the server's rank monitor)
        self._thread = threading.Thread(target=self._loop, name="shiftlm-engine", daemon=True)
        self._thread.start()

    @property
    def num_pending(self) -> int:
        return len(self._sinks)

    def step_running_for(self) -> float:
        """Seconds the current step has been running (0 between steps)."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def max_tokens_left(self, prompt_len: int, n: int = 1) -> int:
        return self.engine.max_tokens_left(prompt_len, n)

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def metrics(self):
        """The engine's `ServingMetrics` (thread-safe: every read and write holds its lock)."""
        return self.engine.metrics

    def stats(self) -> EngineStats:
        return replace(self.engine.stats(), failed_steps=self.failed_steps)

    def check_grammar(self, spec) -> None:
        """Compile and validate a structured-output grammar (any thread; InvalidRequest if it fails)."""
        self.engine.grammars.check(spec)

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> list[AsyncIterator[RequestOutput]]:
        """Admit a request of one or more prompts, or raise InvalidRequest / PromptTooLong /
        Overloaded / EngineDead with nothing queued (a refusal for capacity is counted). Each
        returned iterator yields its prompt's outputs until all samples finish, and aborts the
        prompt in the engine if it is cancelled or dropped (a client that went away)."""
        for prompt_ids in prompts:
            self.engine.check_request(prompt_ids, params)
        commands = [("add", f"req-{next(self._ids)}", prompt_ids, params) for prompt_ids in prompts]
        return self._admit(commands, [params.n] * len(prompts))

    def submit_streams(self, prompt_ids, prefixes, params: list[SamplingParams], layout: str):
        """A stream group (serve/engine/streams.py), checked here once; yields every stream's outputs
        (`out.index` is the stream) until all of them finish."""
        self.engine.check_streams(prompt_ids, prefixes, params, layout)
        command = ("streams", f"req-{next(self._ids)}", prompt_ids, prefixes, params, layout)
        return self._admit([command], [len(prefixes)])[0]

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """`submit` of one prompt."""
        return self.submit([prompt_ids], params)[0]

    def refuse_if_full(self, prompts: int = 1) -> None:
        """Before any work on a request (tokenizing): the 429 or 503 it would get at admission now,
        so that refusals stay fast under a burst. `_admit` decides again, under its lock."""
        if self.error is not None or self.num_pending + prompts > self.max_pending:
            with self._admission:
                self._refuse(prompts)

    def _refuse(self, count: int) -> None:
        if self.error is not None:
            self.engine.metrics.record_rejected()
            raise EngineDead(f"the engine stopped: {self.error}")
        if count > self.max_pending:
            raise InvalidRequest(
                f"the request has {count} prompts but at most {self.max_pending} requests "
                "can be in flight (--max-pending); send fewer prompts per request",
                "prompt",
            )
        if self.num_pending + count > self.max_pending:
            self.engine.metrics.record_rejected()
            raise Overloaded(
                f"{self.num_pending} requests are in flight (limit {self.max_pending}); retry later"
            )

    def _admit(self, commands: list[tuple], counts: list[int]) -> list[AsyncIterator[RequestOutput]]:
        """Count the requests against --max-pending and queue them, under one lock: a hard limit
        (the old count happened only once a handler first read its outputs, after awaits, so 100
        concurrent requests got past a limit of 8). Must run on the event loop that reads them."""
        with self._admission:
            self._refuse(len(commands))
            loop = asyncio.get_running_loop()
            sinks = []
            for command in commands:
                sink = self._sinks[command[1]] = _Sink(loop, asyncio.Queue())
                sinks.append(sink)
        outputs = []
        for command, sink, count in zip(commands, sinks, counts):
            self._post(command)
            stream = self._results(sink, command[1], count)
            weakref.finalize(stream, self._release, command[1])  # never read (e.g. cancelled before)
            outputs.append(stream)
        return outputs

    def _release(self, request_id: str) -> None:
        """A request nobody reads any more: stop counting it, abort it in the engine."""
        if self._sinks.pop(request_id, None) is not None:
            self._post(("abort", request_id))

    async def _results(self, sink: _Sink, request_id: str, count: int) -> AsyncIterator[RequestOutput]:
        """Yield outputs until `count` samples finish."""
        finished = 0
        try:
            while finished < count:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished += item.finish_reason is not None
                yield item
        finally:
            if self._sinks.pop(request_id, None) is not None and finished < count:
                self._post(("abort", request_id))

    def fail(self, reason: str) -> None:
        """The engine cannot go on (a rank died or stalled): fail every request, then `on_fatal`."""
        if self.error is not None:
            return
        self.error = reason
        self._stop = True
        self._wake.set()
        if self.on_fatal is not None:
            self.on_fatal(reason)
        for request_id in list(self._sinks):
            self._deliver(request_id, EngineDead(f"the engine stopped: {reason}"))

    def shutdown(self, reason: str = "the server is shutting down") -> int:
        """Stop the loop after its current step; in-flight requests get a 503 naming `reason`.
        Returns how many requests were aborted so far by shutdowns (it may be called twice)."""
        self._stop = True
        self._wake.set()
        if self.error is None and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)
        pending = [request_id for request_id in self._sinks if request_id not in self._aborted]
        for request_id in pending:
            self._aborted.add(request_id)
            self._deliver(request_id, EngineDead(reason))
        return len(self._aborted)

    def _post(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None:
            try:
                sink.loop.call_soon_threadsafe(sink.queue.put_nowait, item)
            except RuntimeError:  # the event loop is closed (shutdown): nobody is waiting any more
                pass

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, handed to each event loop in one call: one wake-up of the HTTP thread per
        step instead of one per token (32 per step at 32 concurrent requests, each taking the GIL from
        this thread in the middle of the next step's model work)."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is not None:
                batches.setdefault(sink.loop, []).append((sink.queue, output))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the event loop is closed (shutdown): nobody is waiting any more
                pass

    def _loop(self) -> None:
        while not self._stop:
            self._drain_commands()
            if not self.engine.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            self._step_started = time.monotonic()
            try:
                outputs = self.engine.step()
            except StepError as err:
                self._step_started = None
                if self.error is not None:
                    return  # already failed by the rank monitor
                if err.in_runner and self.multi_rank:
                    log.error("engine step failed in the model runner:\n%s", traceback.format_exc())
                    self.fail(self._name_failure(str(err)))
                    return
                self._fail_step(err)
                continue
            self._step_started = None
            self._deliver_step(outputs)
            for request_id, trace in self.engine.take_failed():  # failed alone: the batch went on
                self.failed_requests += 1
                log.error("request %s failed in its step; the others went on:\n%s", request_id, trace)
                reason = trace.strip().splitlines()[-1]
                self._deliver(
                    request_id, StepFailed(f"internal error while running request {request_id}: {reason}")
                )

    def _name_failure(self, reason: str, wait: float = 3.0) -> str:
        """A collective failed: give the rank monitor a moment to say which rank is behind it."""
        deadline = time.monotonic() + wait
        while self.diagnose is not None and time.monotonic() < deadline:
            named = self.diagnose()
            if named is not None:
                return f"{named}; {reason}"
            time.sleep(0.1)
        return f"{reason}; a rank may be down"

    def _fail_step(self, err: StepError) -> None:
        """Fail only the requests of the step that raised, and go on."""
        cause = err.__cause__ or err
        self.failed_steps += 1
        log.error(
            "engine step failed; failing its requests %s and going on:\n%s",
            ", ".join(err.request_ids) or "(none)",
            "".join(traceback.format_exception(cause)),
        )
        for request_id in err.request_ids:
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - the request is failed anyway; keep the engine going
                log.exception("aborting %s after a failed step also failed", request_id)
            self._deliver(
                request_id,
                StepFailed(
                    f"internal error while running request {request_id}: {type(cause).__name__}: {cause}"
                ),
            )

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "abort":
                self.engine.abort(command[1])
                continue
            request_id = command[1]
            try:
                if command[0] == "streams":  # `submit_streams` checked it
                    self.engine.enqueue_streams(*command[1:])
                else:
                    self.engine.enqueue(*command[1:])  # `submit` checked it
            except Exception as err:  # noqa: BLE001 - a broken request must not stop the loop
                log.exception("adding request %s failed", request_id)
                self._deliver(
                    request_id, StepFailed(f"internal error while adding request {request_id}: {err}")
                )


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue_, item in items:
        queue_.put_nowait(item)
