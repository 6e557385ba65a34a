"""The engine step: schedule, run the model (through any `Runner`), sample, detokenize, finish.

    engine = Engine(runner, SchedulerConfig(num_blocks=64), tokenizer, eos_token_ids={2}, vocab_size=32000)
    engine.add_request("r0", prompt_ids, SamplingParams(max_tokens=8, temperature=0))
    while engine.has_work():
        for output in engine.step(): ...

n > 1 samples run as one sequence until the prompt is computed; the first token of every sample is then
drawn from the same logits and the siblings fork, sharing the prompt's full blocks (copy-free).
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TextIO

import torch

from shiftlm.serve.metrics import ServingMetrics
from shiftlm.serve.sampling import SampleRow, TokenLogprob, make_generator, prompt_logprobs, sample_rows
from shiftlm.serve.scheduler import Scheduler, SchedulerConfig, StepPlan
from shiftlm.serve.sequence import FinishReason, InvalidRequest, SamplingParams, Sequence
from shiftlm.serve.stream_group import StreamGroup
from shiftlm.serve.streams import StreamRequests
from shiftlm.serve.text import StreamingText, Tokenizer


class Runner(Protocol):
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Logits [plan.num_samples, vocab] for the chunks with `sample=True`, in plan order."""


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


class PromptTooLong(InvalidRequest):
    """The prompt (plus at least one new token, or its max_tokens) does not fit the model's context;
    a 400 as vLLM answers it."""


@dataclass
class RequestOutput:
    """What one step produced for one sample of a request."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: TokenLogprob | None = None  # of `token_ids[0]`, when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on a request's first output (echo)


@dataclass
class _Request:
    prompt_len: int
    n: int
    arrival: float
    samples: dict[int, Sequence] = field(default_factory=dict)
    texts: dict[int, StreamingText] = field(default_factory=dict)
    generators: dict[int, torch.Generator | None] = field(default_factory=dict)
    last_token_time: dict[int, float] = field(default_factory=dict)
    first_token_time: float | None = None
    num_finished: int = 0
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)  # by prompt position
    prompt_logprobs_sent: bool = False


class Engine:
    """Synchronous engine; `AsyncEngine` runs it in a thread behind the HTTP server."""

    def __init__(
        self,
        runner: Runner,
        config: SchedulerConfig,
        tokenizer: Tokenizer,
        eos_token_ids: set[int],
        vocab_size: int,
        clock: Callable[[], float] = time.monotonic,
        step_log: TextIO | None = None,
    ):
        self.runner = runner
        self.scheduler = Scheduler(config)
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.clock = clock
        self.metrics = ServingMetrics()
        # one JSON line per step: mode, tokens, sequences, decode rows, model seconds
        self.step_log = step_log
        self._requests: dict[str, _Request] = {}
        self.streams = StreamRequests(self)  # multi-stream requests (serve/streams.py)
        self.failed: list[tuple[str, str]] = []  # requests failed alone in a step (`take_failed`)

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def stats(self) -> EngineStats:
        scheduler, metrics = self.scheduler, self.metrics
        with metrics.lock:
            prompt, generation = metrics.prompt_tokens, metrics.generation_tokens
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
        if params.top_k > self.vocab_size:
            raise InvalidRequest(f"top_k must be in [0, {self.vocab_size}] (the vocabulary)", "top_k")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.check_request(prompt_ids, params)
        self.enqueue(request_id, prompt_ids, params)

    def enqueue(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a request that `check_request` has passed."""
        if request_id in self._requests or request_id in self.streams.groups:
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        if params.n > 1 and params.prompt_logprobs is None:  # n samples: an isolated stream group
            self.streams.add_samples(request_id, prompt_ids, params)
            return
        now = self.clock()
        seq = Sequence(request_id, list(prompt_ids), params, arrival_time=now)
        request = _Request(prompt_len=len(prompt_ids), n=params.n, arrival=now)
        self._track(request, seq)
        self._requests[request_id] = request
        self.scheduler.add(seq)
        with self.metrics.lock:
            self.metrics.prompt_tokens += len(prompt_ids)

    def add_streams(
        self,
        request_id: str,
        prompt_ids: list[int],
        prefixes: list[list[int]],
        params: list[SamplingParams],
        layout: str = "timestep",
    ) -> None:
        """A group of len(prefixes) streams over one prompt; outputs carry the stream as `index`
        (serve/streams.py). `streams.check` is its one validation, as `check_request` is a request's."""
        self.streams.check(prompt_ids, prefixes, params, layout)
        self.enqueue_streams(request_id, prompt_ids, prefixes, params, layout)

    def enqueue_streams(self, request_id: str, prompt_ids, prefixes, params, layout: str) -> None:
        if request_id in self._requests or request_id in self.streams.groups:
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        self.streams.add(request_id, prompt_ids, prefixes, params, layout)

    def abort(self, request_id: str) -> None:
        if self.streams.abort(request_id):
            return
        request = self._requests.pop(request_id, None)
        for seq in request.samples.values() if request else ():
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.ABORT)
        if request:
            self.metrics.record_finished(FinishReason.ABORT.value)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        started = time.perf_counter()
        logits = self.runner.execute(plan)
        self._record_step(plan, started, time.perf_counter() - started)
        sample_at = self._collect_prompt_logprobs(plan, logits)
        sampled = self.scheduler.complete_step(plan)
        # One sampler call for the step: each sampled sequence, plus the first token of every sibling
        # of an n > 1 request whose prompt just finished (drawn from the same logits row). A request
        # whose rows fail to build, sample or detokenize fails alone (`failed`), never its batch.
        failed: dict[str, str] = {}
        rows: list[SampleRow] = []
        owners: list[str] = []  # the request of each row
        forks: list[list[tuple[int, torch.Generator | None]] | None] = []
        pairs = list(zip(sample_at, sampled))  # stream groups draw through self.streams
        groups = [(row, seq) for row, seq in pairs if isinstance(seq, StreamGroup)]
        singles = [(row, seq) for row, seq in pairs if not isinstance(seq, StreamGroup)]
        for row, seq in singles:
            try:
                request = self._requests[seq.request_id]
                history = (seq.prompt_ids, seq.output_ids)
                mine = [SampleRow(row, seq.params, request.generators[seq.sample_index], *history)]
                siblings = []
                if request.n > 1 and seq.sample_index == 0 and len(request.samples) == 1:
                    for index in range(1, request.n):
                        generator = make_generator(seq.params, index)
                        mine.append(SampleRow(row, seq.params, generator, *history))
                        siblings.append((index, generator))
            except Exception:  # noqa: BLE001 - this request fails alone
                failed[seq.request_id] = traceback.format_exc()
                forks.append(None)
                continue
            rows += mine
            owners += [seq.request_id] * len(mine)
            forks.append(siblings)
        group_rows: list[tuple[list[SampleRow], list[int]] | None] = []
        for row, group in groups:
            try:
                extra, streams = self.streams.sample_rows(group, row)
            except Exception:  # noqa: BLE001
                failed[group.request_id] = traceback.format_exc()
                group_rows.append(None)
                continue
            rows += extra
            owners += [group.request_id] * len(extra)
            group_rows.append((extra, streams))
        drawn = iter(self._sample(logits, rows, owners, failed))
        outputs: list[RequestOutput] = []
        now = self.clock()
        for (_, seq), siblings in zip(singles, forks):
            if siblings is None:
                continue
            picks = [next(drawn) for _ in range(1 + len(siblings))]
            if seq.request_id in failed:
                continue
            try:
                request = self._requests[seq.request_id]
                # Fork before the parent can finish and free the prompt blocks the siblings share.
                children = [
                    self._fork(request, seq, index, gen, *pick)
                    for (index, gen), pick in zip(siblings, picks[1:])
                ]
                token, logprob = picks[0]
                mine = [self._append(request, seq, token, now, logprob)]
                mine += [self._after_token(request, child, now, lp) for child, lp in children]
            except Exception:  # noqa: BLE001
                failed[seq.request_id] = traceback.format_exc()
                continue
            outputs += mine
        for (_, group), entry in zip(groups, group_rows):
            if entry is None:
                continue
            picks = [next(drawn) for _ in entry[1]]
            if group.request_id in failed:
                continue
            try:
                outputs += self.streams.advance(group, entry[1], picks, now)
            except Exception:  # noqa: BLE001
                failed[group.request_id] = traceback.format_exc()
        if failed:
            outputs = [out for out in outputs if out.request_id not in failed]
            for request_id, trace in failed.items():
                self._fail_request(request_id, trace)
        return outputs

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow], owners: list[str], failed: dict) -> list:
        """(token, logprob) per row: one sampler call; if it raises, row by row, so that only the
        requests whose rows raise fail (recorded in `failed`; their entries are placeholders)."""
        try:
            result = sample_rows(logits, rows, self.eos_token_ids)
            return list(zip(result.tokens, result.logprobs))
        except Exception:  # noqa: BLE001 - find the row(s) that raise
            pass
        picks = []
        for row, owner in zip(rows, owners):
            try:
                one = sample_rows(logits, [row], self.eos_token_ids)
                picks.append((one.tokens[0], one.logprobs[0]))
            except Exception:  # noqa: BLE001
                failed.setdefault(owner, traceback.format_exc())
                picks.append((0, None))
        return picks

    def _fail_request(self, request_id: str, trace: str) -> None:
        """Abort one request whose sampling or detokenization raised; `take_failed` hands it over."""
        try:
            self.abort(request_id)
        except Exception:  # noqa: BLE001 - it is failed either way
            trace += "\n(aborting it also failed)\n" + traceback.format_exc()
        self.failed.append((request_id, trace))

    def take_failed(self) -> list[tuple[str, str]]:
        """The requests that failed alone since the last call: (request id, traceback)."""
        failed, self.failed = self.failed, []
        return failed

    def _collect_prompt_logprobs(self, plan: StepPlan, logits: torch.Tensor) -> list[int]:
        """Record prompt logprobs of `all_logits` chunks; return the logits row of each sampled chunk."""
        sample_at, row = [], 0
        for chunk in plan.chunks:
            rows = chunk.num_logits_rows
            seq = self.scheduler.sequence(chunk.seq_id)
            if chunk.all_logits and seq is not None and seq.request_id in self._requests:
                request = self._requests[seq.request_id]
                # row j predicts the token at position start + j + 1; keep those inside the prompt
                count = min(rows, len(seq.prompt_ids) - 1 - chunk.start)
                if count > 0 and seq.sample_index == 0:
                    next_ids = seq.prompt_ids[chunk.start + 1 : chunk.start + 1 + count]
                    entries = prompt_logprobs(logits[row : row + count], next_ids, seq.params.prompt_logprobs)
                    for offset, entry in enumerate(entries):
                        request.prompt_logprobs[chunk.start + 1 + offset] = entry
            if chunk.sample:
                sample_at.append(row + rows - 1)
            row += rows
        return sample_at

    def _record_step(self, plan: StepPlan, started: float, seconds: float) -> None:
        self.metrics.record_step(plan.mode.value, plan.num_tokens, seconds)
        if self.step_log is not None:
            record = {"step": plan.step, "mode": plan.mode.value, "tokens": plan.num_tokens}
            # start: time.perf_counter() (the host's monotonic clock, comparable across processes)
            # decodes: the one-token chunks (decode rows); the other chunks are prompt chunks
            decodes = sum(len(chunk.token_ids) == 1 for chunk in plan.chunks)
            record.update(
                seqs=len(plan.chunks), decodes=decodes, start=round(started, 6), seconds=round(seconds, 6)
            )
            self.step_log.write(json.dumps(record) + "\n")

    def _fork(
        self,
        request: _Request,
        parent: Sequence,
        index: int,
        generator: torch.Generator | None,
        token: int,
        logprob: TokenLogprob | None,
    ) -> tuple[Sequence, TokenLogprob | None]:
        """Sample `index` of an n > 1 request: its first token came from the prompt's logits."""
        child = parent.fork(index, token)
        self._track(request, child, generator)
        self.scheduler.add_fork(parent, child)
        return child, logprob

    def _track(self, request: _Request, seq: Sequence, generator: torch.Generator | None = None) -> None:
        request.samples[seq.sample_index] = seq
        request.texts[seq.sample_index] = StreamingText(self.tokenizer, seq.params.stop)
        request.generators[seq.sample_index] = generator or make_generator(seq.params, seq.sample_index)

    def _append(
        self, request: _Request, seq: Sequence, token: int, now: float, logprob: TokenLogprob | None
    ) -> RequestOutput:
        seq.output_ids.append(token)
        return self._after_token(request, seq, now, logprob)

    def _after_token(
        self, request: _Request, seq: Sequence, now: float, logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        """Account for the token just appended to `seq`; finish the sample if it is done."""
        token = seq.output_ids[-1]
        index = seq.sample_index
        with self.metrics.lock:
            self.metrics.generation_tokens += 1
            if request.first_token_time is None:
                request.first_token_time = now
                self.metrics.ttft.observe(now - request.arrival)
            elif index in request.last_token_time:
                self.metrics.itl.observe(now - request.last_token_time[index])
        request.last_token_time[index] = now
        text = request.texts[index]
        delta = text.update(seq.output_ids)
        reason = self._finish_reason(seq, token, text.stopped)
        if reason is not None:
            delta += text.flush()
            self.scheduler.finish(seq, reason)
            request.num_finished += 1
            if request.num_finished == request.n:
                del self._requests[seq.request_id]
                self.metrics.record_finished(reason.value)
                with self.metrics.lock:
                    self.metrics.e2e.observe(now - request.arrival)
        return RequestOutput(
            request_id=seq.request_id,
            index=index,
            text=delta,
            token_ids=[token],
            finish_reason=reason.value if reason else None,
            prompt_tokens=request.prompt_len,
            completion_tokens=len(seq.output_ids),
            logprobs=logprob,
            prompt_logprobs=self._take_prompt_logprobs(request, seq),
        )

    def _take_prompt_logprobs(self, request: _Request, seq: Sequence) -> list[TokenLogprob | None] | None:
        """The prompt's logprobs (position 0 has none), once per request, with its first output."""
        if seq.params.prompt_logprobs is None or request.prompt_logprobs_sent:
            return None
        request.prompt_logprobs_sent = True
        return [None] + [request.prompt_logprobs.get(i) for i in range(1, request.prompt_len)]

    def _finish_reason(self, seq: Sequence, token: int, stopped: bool) -> FinishReason | None:
        if stopped or (token in self.eos_token_ids and not seq.params.ignore_eos):
            return FinishReason.STOP
        if len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
