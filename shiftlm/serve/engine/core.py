"""The engine step: schedule, run the model (through any `plan.Runner`), sample, detokenize, finish.

    engine = Engine(runner, SchedulerConfig(num_blocks=64), tokenizer, eos_token_ids={2}, vocab_size=32000)
    engine.add_request("r0", prompt_ids, SamplingParams(max_tokens=8, temperature=0))
    while engine.has_work():
        for output in engine.step(): ...

Every request is a `requests.Request`: one sequence (`SingleRequest`), or a stream group
(`StreamRequest`): the streams of /v1/streams, and OpenAI's n > 1 as n `isolated` streams holding
the prompt once. A step asks each sampled request for its rows, draws them in one sampler call and
hands each request its tokens; a request whose rows fail to build, sample or detokenize fails alone.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TextIO

import torch

from shiftlm.serve.engine.errors import InvalidRequest, PromptTooLong, StepError
from shiftlm.serve.engine.launched import Launched
from shiftlm.serve.engine.metrics import ServingMetrics, step_record
from shiftlm.serve.engine.requests import Request, RequestContext, RequestOutput, SingleRequest, StreamRequest
from shiftlm.serve.engine.sampling import SEED_MODULUS, draw_rows, sample_rows
from shiftlm.serve.engine.scheduler import Scheduler, SchedulerConfig
from shiftlm.serve.engine.sequence import SamplingParams
from shiftlm.serve.engine.streams import check_group_fits, check_streams, layout_code, max_step_cost
from shiftlm.serve.engine.structured import Grammars
from shiftlm.serve.plan import Runner, StepPlan

__all__ = ["Engine", "EngineStats", "RequestOutput"]


@dataclass(frozen=True)
class EngineStats:
    """What the engine reports about itself (the /metrics gauges and counters, the stats line)."""

    running: int
    waiting: int
    kv_cache_usage: float
    mode_switches: int
    preemptions: int
    prefix_cache_hit_tokens: int
    steps_per_mode: dict[str, int]
    prompt_tokens: int
    generation_tokens: int
    failed_steps: int = 0  # steps that raised (counted by `AsyncEngine`, which catches them)


class Engine:
    """The engine (synchronous calls); `AsyncEngine` runs it in a thread behind the HTTP server."""

    def __init__(
        self,
        runner: Runner,
        config: SchedulerConfig,
        tokenizer,
        eos_token_ids: set[int],
        vocab_size: int,
        clock: Callable[[], float] = time.monotonic,
        step_log: TextIO | None = None,
        sliding_window: int | None = None,
        async_scheduling: bool = False,
        json_any_whitespace: bool = False,
    ):
        """`async_scheduling` (`--async-scheduling`): schedule step N+1 while step N runs (`step`);
        the runner must take a plan's pending tokens (`runs_ahead`)."""
        if async_scheduling and not getattr(runner, "runs_ahead", False):
            raise ValueError(
                f"{type(runner).__name__} cannot run a step ahead of its tokens (async_scheduling)"
            )
        if async_scheduling and config.speculative is not None:  # drafts follow the tokens kept
            raise ValueError("speculative decoding cannot run with async_scheduling")
        self.runner = runner
        self.async_scheduling = async_scheduling
        self._running: Launched | None = None  # the step launched ahead (async_scheduling)
        self.scheduler = Scheduler(config)
        self.vocab_size = vocab_size
        self.sliding_window = sliding_window  # the model's (only isolated stream groups may have one)
        self.clock = clock
        self.metrics = ServingMetrics()
        # one JSON line per step: mode, tokens, sequences, decode rows, model seconds
        self.step_log = step_log
        # structured outputs' compiler
        self.grammars = Grammars(tokenizer, vocab_size, eos_token_ids, json_any_whitespace)
        self._ctx = RequestContext(
            self.scheduler, self.metrics, tokenizer, eos_token_ids, config.max_model_len, clock, self.grammars
        )
        self._requests: dict[str, Request] = {}
        self._failed: list[tuple[str, str]] = []  # requests failed alone in a step (`take_failed`)

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def max_tokens_left(self, prompt_len: int, n: int = 1) -> int:
        """The most a request may generate (the default of a request without max_tokens): what the
        context leaves and, for n > 1 samples (one group in the cache), each one's share of the cache."""
        left = self.max_model_len - prompt_len
        if n > 1:
            left = min(left, (self.scheduler.config.cache_tokens - prompt_len) // n)
        return max(1, left)

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        prompt, generation = self.metrics.token_counts()
        return EngineStats(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            kv_cache_usage=scheduler.blocks.allocator.usage,
            mode_switches=scheduler.stats.mode_switches,
            preemptions=scheduler.stats.preemptions,
            prefix_cache_hit_tokens=scheduler.blocks.prefix_hits,
            steps_per_mode=dict(scheduler.stats.steps_per_mode),
            prompt_tokens=prompt,
            generation_tokens=generation,
        )

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest (or PromptTooLong) for a request this engine cannot run; no side effects.
        The one validation of a request: `add_request` runs it, `AsyncEngine.submit` runs it once per
        prompt before anything is queued."""
        params.validate()
        for token_id, _ in params.logit_bias:
            if not 0 <= token_id < self.vocab_size:
                raise InvalidRequest(
                    f"logit_bias token {token_id} is not in [0, {self.vocab_size})", "logit_bias"
                )
        if not all(0 <= token_id < self.vocab_size for token_id in params.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be in [0, {self.vocab_size})", "stop_token_ids")
        if params.structured_outputs is not None:  # compiled once per grammar (cached)
            self.grammars.check(params.structured_outputs)
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty; send at least one token", "prompt")
        if not all(0 <= token < self.vocab_size for token in prompt_ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise PromptTooLong(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.max_model_len} "
                "(including at least one generated token); shorten the prompt",
                "prompt",
            )
        if len(prompt_ids) + params.max_tokens > self.max_model_len:  # vLLM's 400, never a silent clip
            raise PromptTooLong(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{len(prompt_ids) + params.max_tokens} were requested ({len(prompt_ids)} in the prompt, "
                f"{params.max_tokens} in max_tokens); lower max_tokens or shorten the prompt",
                "max_tokens",
            )
        if params.priority and self.scheduler.config.scheduling_policy != "priority":
            message = f"priority {params.priority} needs --scheduling-policy priority; or leave priority out"
            raise InvalidRequest(message, "priority")
        if params.top_k > self.vocab_size:
            raise InvalidRequest(f"top_k must be in [0, {self.vocab_size}] (the vocabulary)", "top_k")
        if params.n > 1:  # the n samples run as one group (`enqueue`): all of it must fit the cache
            check_group_fits(self, prompt_ids, [[]] * params.n, [params] * params.n, "isolated", "n")

    def check_streams(self, prompt_ids, prefixes, params: list[SamplingParams], layout: str) -> None:
        """Raise InvalidRequest for a stream group this engine cannot run; no side effects
        (`streams.check_streams`), as `check_request` is a request's."""
        check_streams(self, prompt_ids, prefixes, params, layout)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.check_request(prompt_ids, params)
        self.enqueue(request_id, prompt_ids, params)

    def enqueue(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a request that `check_request` has passed; n > 1 samples: n isolated streams, sample
        i drawing with seed + i."""
        if params.n == 1:
            self._admit(SingleRequest.create(self._ctx, request_id, prompt_ids, params), len(prompt_ids))
            return
        seeds = [None if params.seed is None else (params.seed + i) % SEED_MODULUS for i in range(params.n)]
        samples = [replace(params, n=1, seed=seed, prompt_logprobs=None) for seed in seeds]
        echo = params if params.prompt_logprobs is not None else None
        self._enqueue_group(request_id, prompt_ids, [[] for _ in samples], samples, "isolated", echo)

    def add_streams(
        self,
        request_id: str,
        prompt_ids: list[int],
        prefixes: list[list[int]],
        params: list[SamplingParams],
        layout: str = "timestep",
    ) -> None:
        """A group of len(prefixes) streams over one prompt; outputs carry the stream as `index`
        (engine/streams.py)."""
        self.check_streams(prompt_ids, prefixes, params, layout)
        self.enqueue_streams(request_id, prompt_ids, prefixes, params, layout)

    def enqueue_streams(self, request_id: str, prompt_ids, prefixes, params, layout: str) -> None:
        """Queue a stream group that `check_streams` has passed."""
        self._enqueue_group(request_id, prompt_ids, prefixes, params, layout)

    def _enqueue_group(self, request_id, prompt_ids, prefixes, params, layout: str, echo=None) -> None:
        limit = max_step_cost(self.scheduler.config)
        request = StreamRequest.create(
            self._ctx, request_id, prompt_ids, prefixes, params, layout_code(layout), limit, echo
        )
        self._admit(request, len(prompt_ids) + sum(len(x) for x in prefixes))

    def _admit(self, request: Request, prompt_tokens: int) -> None:
        if request.request_id in self._requests:
            raise InvalidRequest(f"request id {request.request_id!r} is already in use", "request_id")
        self._requests[request.request_id] = request
        self.scheduler.add(request.seq)
        self.metrics.record_prompt(prompt_tokens)

    def abort(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is not None:
            request.abort()

    def has_work(self) -> bool:
        return self._running is not None or self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """One engine step: the outputs of one model step. Raises `StepError` (naming the step's
        requests, the cause chained) when anything but one request's own rows raises; a request whose
        rows fail is failed alone.

        With `async_scheduling`, step N+1 is scheduled and launched before step N's tokens are read
        (vLLM's asynchronous scheduling): the next plan carries N's draws as `PENDING` tokens that
        the runner reads on the device, so on a GPU the host's work (reading N's tokens, detokenizing,
        stop checks, scheduling) overlaps the device running N+1. A sequence that stops at N (EOS, a
        stop string, an abort) has computed one token for nothing at N+1, which is dropped. A draw that
        reads the tokens so far (penalties, min_tokens) takes N's from the device. The engine runs a
        step without an overlap (it waits for N first) when N drew for a stream group, or when only
        preempting could make room."""
        plans: list[StepPlan] = []
        try:
            current, self._running = self._running, None
            if current is None:
                plan = self.scheduler.schedule()
                if plan is None:
                    return []
                plans.append(plan)
                current = self._launch(plan)
            plans.append(current.plan)
            if self.async_scheduling and self._can_run_ahead(current):
                plan = self.scheduler.schedule(ahead=True)
                if plan is not None:
                    plans.append(plan)
                    self._running = self._launch(plan, current)
            return self._finish(current)
        except StepError:
            raise
        except Exception as err:
            ids = (
                sorted({i for plan in plans for i in self._request_ids(plan)})
                if plans
                else [s.request_id for s in self.scheduler.running]
            )
            raise StepError(f"{type(err).__name__}: {err}", sorted(set(ids)), in_runner=False) from err

    def _can_run_ahead(self, current: Launched) -> bool:
        """Step N+1 may be scheduled before N's tokens are read: every request N draws for is one plain
        sequence (a stream group's next timestep depends on which of its streams stopped) without a
        grammar (its next mask needs the token on the host)."""
        return all(
            isinstance(request, SingleRequest) and request.seq.params.structured_outputs is None
            for request, _ in current.drawing
        )

    def _launch(self, plan: StepPlan, previous: Launched | None = None) -> Launched:
        """Run `plan` and draw its tokens, reading nothing back. `previous`: the step still running,
        whose draws are this plan's `PENDING` tokens."""
        started = time.perf_counter()
        try:
            pending = previous.pending_tokens(plan) if previous is not None else None
            if pending is None:
                logits = self.runner.execute(plan)
            else:
                logits = self.runner.execute(plan, pending=pending)
        except Exception as err:
            message = f"the model runner failed ({type(err).__name__}: {err})"
            ids = sorted({*self._request_ids(plan), *(self._request_ids(previous.plan) if previous else ())})
            raise StepError(message, ids, in_runner=True) from err
        self._record_step(plan, started, time.perf_counter() - started)
        launched = Launched(plan, logits)
        row = 0
        for chunk in plan.chunks:
            row += chunk.num_logits_rows
            if not chunk.sample:
                continue
            seq = self.scheduler.sequence(chunk.seq_id)
            request = self._requests.get(seq.request_id) if seq is not None else None
            if request is None:
                continue
            try:
                mine = request.rows(row - 1)
            except Exception:  # noqa: BLE001 - this request fails alone
                launched.failed[request.request_id] = traceback.format_exc()
                continue
            if previous is not None and seq.params.reads_own_tokens and seq.seq_id in previous.pending_row:
                mine = [replace(r, pending=previous.token(seq.seq_id)) for r in mine]  # penalties read it
            if self.async_scheduling and isinstance(request, SingleRequest):
                seq.num_pending += 1  # counted in its tokens until `_finish` appends it
                launched.pending_row[seq.seq_id] = len(launched.rows)
            launched.rows += mine
            launched.owners += [request.request_id] * len(mine)
            launched.drawing.append((request, len(mine)))
        launched.draw = self._draw(logits, launched)
        return launched

    def _finish(self, launched: Launched) -> list[RequestOutput]:
        """Read a launched step's tokens and hand each request its own."""
        plan, failed = launched.plan, launched.failed
        self._collect_prompt_logprobs(plan, launched.logits)
        self.scheduler.complete_step(plan)
        result = launched.draw.result() if launched.draw is not None else None
        drawn = iter(zip(result.tokens, result.logprobs) if result is not None else launched.picks)
        outputs: list[RequestOutput] = []
        now = self.clock()
        for request, count in launched.drawing:
            picks = [next(drawn) for _ in range(count)]
            if request.seq.seq_id in launched.pending_row:
                request.seq.num_pending -= 1
            if request.request_id in failed or self._requests.get(request.request_id) is not request:
                continue  # failed, or finished or aborted since this step was launched
            try:
                outputs += request.advance(picks, now)
            except Exception:  # noqa: BLE001
                failed[request.request_id] = traceback.format_exc()
                continue
            if request.done():
                self._requests.pop(request.request_id, None)
        if failed:
            outputs = [out for out in outputs if out.request_id not in failed]
            for request_id, trace in failed.items():
                self._fail_request(request_id, trace)
        return outputs

    def _request_ids(self, plan: StepPlan) -> list[str]:
        seqs = [self.scheduler.sequence(chunk.seq_id) for chunk in plan.chunks]
        return sorted({seq.request_id for seq in seqs if seq is not None})

    def _draw(self, logits: torch.Tensor, launched: Launched):
        """The step's draws in one sampler call (`Draw`, still on the device); if it raises, row by row
        on the host, so that only the requests whose rows raise fail (recorded in `failed`; their
        entries are placeholders): then None, and `launched.picks` holds them."""
        rows, owners, failed = launched.rows, launched.owners, launched.failed
        eos = self._ctx.eos_token_ids
        try:
            return draw_rows(logits, rows, eos)
        except Exception:  # noqa: BLE001 - find the row(s) that raise
            pass
        picks = []
        for row, owner in zip(rows, owners):
            try:
                one = sample_rows(logits, [row], eos)
                picks.append((one.tokens[0], one.logprobs[0]))
            except Exception:  # noqa: BLE001
                failed.setdefault(owner, traceback.format_exc())
                picks.append((0, None))
        launched.picks = picks
        return None

    def _fail_request(self, request_id: str, trace: str) -> None:
        """Abort one request whose sampling or detokenization raised; `take_failed` hands it over."""
        try:
            self.abort(request_id)
        except Exception:  # noqa: BLE001 - it is failed either way
            trace += "\n(aborting it also failed)\n" + traceback.format_exc()
        self._failed.append((request_id, trace))

    def take_failed(self) -> list[tuple[str, str]]:
        """The requests that failed alone since the last call: (request id, traceback)."""
        failed, self._failed = self._failed, []
        return failed

    def _collect_prompt_logprobs(self, plan: StepPlan, logits: torch.Tensor) -> None:
        """Record the prompt logprobs of `all_logits` chunks."""
        row = 0
        for chunk in plan.chunks:
            rows = chunk.num_logits_rows
            if chunk.all_logits:
                seq = self.scheduler.sequence(chunk.seq_id)
                request = self._requests.get(seq.request_id) if seq is not None else None
                if request is not None:
                    request.record_prompt_logprobs(chunk, logits[row : row + rows])
            row += rows

    def _record_step(self, plan: StepPlan, started: float, seconds: float) -> None:
        self.metrics.record_step(plan.mode.value, plan.num_tokens, seconds)
        if self.step_log is not None:
            record = step_record(plan, started, seconds, self.metrics.last_expert_rows)
            self.step_log.write(json.dumps(record) + "\n")
