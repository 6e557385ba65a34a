"""A request inside the engine: one interface, two kinds.

    request = SingleRequest(...) or StreamRequest(...)   # one sequence / a stream group (n > 1, /v1/streams)
    rows = request.rows(last_row)                        # the sampler rows it draws this step
    outputs = request.advance(picks, now)                # append the drawn tokens; what they produced
    request.abort()

Both kinds hold the scheduler's sequence (`Sequence`, or `StreamGroup` for streams) and report each
drawn token through `_emit`, the one place that accounts latency (TTFT, ITL), detokenizes, decides the
finish reason and hands out the prompt's logprobs; `_finish` is the one place a request ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shiftlm.serve.engine.metrics import ServingMetrics
from shiftlm.serve.engine.sampling import SampleRow, TokenLogprob, make_generator, prompt_logprobs
from shiftlm.serve.engine.scheduler import Scheduler
from shiftlm.serve.engine.sequence import FinishReason, SamplingParams, Sequence
from shiftlm.serve.engine.stream_group import StreamGroup
from shiftlm.serve.engine.structured import Grammars, Matcher
from shiftlm.serve.engine.text import StreamingText, Tokenizer
from shiftlm.serve.plan import ScheduledChunk


@dataclass
class RequestOutput:
    """What one step produced for one sample (or stream) of a request."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: TokenLogprob | None = None  # of `token_ids[0]`, when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on a request's first output (echo)
    # vLLM's: the stop token id or stop string that finished the sample (None for EOS, a grammar, length)
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class RequestContext:
    """What every request of one engine shares."""

    scheduler: Scheduler
    metrics: ServingMetrics
    tokenizer: Tokenizer
    eos_token_ids: set[int]
    max_model_len: int
    clock: Callable[[], float]
    grammars: Grammars | None = None  # structured outputs' compiler (None: no request may ask)


@dataclass
class _Sample:
    """One sample's (or stream's) own state."""

    params: SamplingParams
    text: StreamingText
    generator: torch.Generator | None
    prompt_tokens: int
    last_token_time: float | None = None
    finish: FinishReason | None = None
    matcher: Matcher | None = None  # its place in its grammar (structured outputs)
    # a seeded speculative step's generator states after each row's draw, by logits row, and its first
    # row (`SingleRequest.advance` rewinds the generator to the last kept draw)
    generator_states: dict[int, torch.Tensor] | None = None
    first_row: int = 0

    def allowed(self) -> torch.Tensor | None:
        return None if self.matcher is None else self.matcher.allowed()


@dataclass(eq=False)
class Request:
    """The part both kinds share; `rows` and `advance` are each kind's own."""

    ctx: RequestContext
    seq: Sequence
    samples: list[_Sample]
    arrival: float
    first_token_time: float | None = None
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)  # by prompt position
    prompt_logprobs_sent: bool = False

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    def rows(self, last_row: int) -> list[SampleRow]:
        """The sampler rows this step draws for the request (`last_row`: its chunk's last logits row)."""
        raise NotImplementedError

    def advance(self, picks: list[tuple[int, TokenLogprob | None]], now: float) -> list[RequestOutput]:
        """Append the tokens drawn for `rows` (in their order); the outputs they produced."""
        raise NotImplementedError

    def record_prompt_logprobs(self, chunk: ScheduledChunk, logits: torch.Tensor) -> None:
        """Keep the logprobs of the prompt tokens an `all_logits` chunk scored (`logits`: its rows;
        row j predicts the token at position chunk.start + j + 1)."""
        prompt = self.seq.prompt_ids
        count = min(len(logits), len(prompt) - 1 - chunk.start)
        if count > 0:
            next_ids = prompt[chunk.start + 1 : chunk.start + 1 + count]
            entries = prompt_logprobs(logits[:count], next_ids, self.seq.params.prompt_logprobs)
            for offset, entry in enumerate(entries):
                self.prompt_logprobs[chunk.start + 1 + offset] = entry

    def abort(self) -> None:
        if not self.seq.is_finished:
            self.ctx.scheduler.finish(self.seq, FinishReason.ABORT)
        self.ctx.metrics.record_finished(FinishReason.ABORT.value)

    def _emit(
        self, index: int, token: int, generated: list[int], logprob: TokenLogprob | None, now: float
    ) -> RequestOutput:
        """Sample `index` drew `token` (already appended to `generated`): account for it, finish the
        sample if it is done, and say what it produced."""
        sample = self.samples[index]
        ttft = itl = None
        if self.first_token_time is None:
            self.first_token_time = now
            ttft = now - self.arrival
        elif sample.last_token_time is not None:
            itl = now - sample.last_token_time
        self.ctx.metrics.record_token(ttft, itl)
        sample.last_token_time = now
        params = sample.params
        stop_token = token in params.stop_token_ids or (
            token in self.ctx.eos_token_ids and not params.ignore_eos
        )
        # a stop token is in the sample's token ids, not in its text (as vLLM's detokenizer skips it)
        skip_last = stop_token and not params.include_stop_str_in_output
        delta = sample.text.update(generated[:-1] if skip_last else generated)
        complete = sample.matcher is not None and sample.matcher.accept(token)  # the grammar takes no more
        if stop_token or complete or sample.text.stopped:
            sample.finish = FinishReason.STOP
        elif (
            len(generated) >= params.max_tokens
            or sample.prompt_tokens + len(generated) >= self.ctx.max_model_len
        ):
            sample.finish = FinishReason.LENGTH
        stop_reason = None
        if sample.finish is not None:
            delta += sample.text.flush()
            if token in params.stop_token_ids:
                stop_reason = token
            elif sample.text.stopped:
                stop_reason = sample.text.stop_string
        return RequestOutput(
            request_id=self.request_id,
            index=index,
            text=delta,
            token_ids=[token],
            finish_reason=sample.finish.value if sample.finish else None,
            prompt_tokens=sample.prompt_tokens,
            completion_tokens=len(generated),
            logprobs=logprob,
            prompt_logprobs=self._take_prompt_logprobs(),
            stop_reason=stop_reason,
        )

    def _take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The prompt's logprobs (position 0 has none), once per request, with its first output."""
        if self.seq.params.prompt_logprobs is None or self.prompt_logprobs_sent:
            return None
        self.prompt_logprobs_sent = True
        prompt_len = len(self.seq.prompt_ids)
        return [None] + [self.prompt_logprobs.get(i) for i in range(1, prompt_len)]

    def done(self) -> bool:
        return all(sample.finish is not None for sample in self.samples)

    def _finish(self, now: float) -> None:
        """Every sample is done: free the sequence, count the request by its reason."""
        reasons = {sample.finish for sample in self.samples}
        reason = FinishReason.LENGTH if reasons == {FinishReason.LENGTH} else FinishReason.STOP
        self.ctx.scheduler.finish(self.seq, reason)
        self.ctx.metrics.record_finished(reason.value, now - self.arrival)


class SingleRequest(Request):
    """One prompt, one sample: one `Sequence`."""

    @classmethod
    def create(cls, ctx: RequestContext, request_id: str, prompt_ids: list[int], params: SamplingParams):
        now = ctx.clock()
        seq = Sequence(request_id, list(prompt_ids), params, arrival_time=now)
        sample = _Sample(
            params,
            _text(ctx, params),
            make_generator(params, 0),
            len(prompt_ids),
            matcher=_matcher(ctx, params, prompt_ids),
        )
        return cls(ctx, seq, [sample], now)

    def rows(self, last_row: int) -> list[SampleRow]:
        seq, sample = self.seq, self.samples[0]
        drafts = seq.draft_ids
        if not drafts:
            history = (seq.prompt_ids, seq.output_ids)
            return [SampleRow(last_row, seq.params, sample.generator, *history, allowed=sample.allowed())]
        # speculative decoding: the chunk's last k + 1 rows; row j's history holds drafts 1..j, what
        # the sample's outputs are if its draws are kept that far (penalties, min_tokens read it)
        first = last_row - len(drafts)
        masks = [None] * (len(drafts) + 1)
        if sample.matcher is not None:  # only the drafts its grammar takes are verified
            drafts, masks = sample.matcher.draft_masks(drafts)
            seq.draft_ids = drafts
        sample.first_row = first
        sample.generator_states = {} if sample.generator is not None else None
        return [
            SampleRow(
                first + j,
                seq.params,
                sample.generator,
                seq.prompt_ids,
                [*seq.output_ids, *drafts[:j]],
                allowed=masks[j],
                generator_states=sample.generator_states,
            )
            for j in range(len(drafts) + 1)
        ]

    def advance(self, picks, now):
        """One token, or with drafts (engine/speculative.py) the draws up to and including the first
        that differs from its draft (or the one after the last draft), as far as the sample goes."""
        seq, sample = self.seq, self.samples[0]
        drafts, seq.draft_ids = seq.draft_ids, []
        outputs = []
        for j, (token, logprob) in enumerate(picks):
            seq.output_ids.append(token)
            outputs.append(self._emit(0, token, seq.output_ids, logprob, now))
            if sample.finish is not None or j >= len(drafts) or token != drafts[j]:
                break
            seq.num_computed += 1  # the draft is its next token: the K/V this step wrote for it stand
        if drafts:
            kept = len(outputs)
            accepted = sum(token == draft for (token, _), draft in zip(picks[:kept], drafts))
            self.ctx.metrics.record_speculation(len(drafts), accepted)
            if sample.generator_states is not None and kept < len(picks):  # as if only `kept` were drawn
                sample.generator.set_state(sample.generator_states[sample.first_row + kept - 1])
            sample.generator_states = None
        if self.done():
            self._finish(now)
        return outputs


class StreamRequest(Request):
    """A stream group (`StreamGroup`): K streams over one prompt, each its own sample. OpenAI's n > 1
    is K `isolated` streams with empty prefixes (the prompt held once), stream k drawing with seed + k."""

    seq: StreamGroup

    @classmethod
    def create(
        cls,
        ctx: RequestContext,
        request_id: str,
        prompt_ids: list[int],
        prefixes: list[list[int]],
        params: list[SamplingParams],
        layout: int,
        max_step_cost: int,
        echo: SamplingParams | None = None,
    ):
        """`echo`: the request's own parameters when it asked for its prompt's logprobs (n > 1)."""
        now = ctx.clock()
        group = StreamGroup.create(
            request_id, prompt_ids, prefixes, params, layout, arrival_time=now, max_step_cost=max_step_cost
        )
        if echo is not None:  # the group's own parameters decide what the scheduler scores
            group.params = echo
        samples = [
            _Sample(
                p,
                _text(ctx, p),
                make_generator(p, 0),
                len(prompt_ids) + len(prefix),
                matcher=_matcher(ctx, p, [*prompt_ids, *prefix]),
            )
            for p, prefix in zip(params, prefixes)
        ]
        return cls(ctx, group, samples, now)

    def rows(self, last_row: int) -> list[SampleRow]:
        group = self.seq
        first = last_row - group.num_sampled_rows + 1
        rows = []
        for k, offset in group.to_sample():
            history = (group.prompt_ids + list(group.prefixes[k]), group.generated[k])
            sample = self.samples[k]
            rows.append(
                SampleRow(
                    first + offset,
                    group.stream_params[k],
                    sample.generator,
                    *history,
                    allowed=sample.allowed(),
                )
            )
        return rows

    def advance(self, picks, now):
        group = self.seq
        streams = [k for k, _ in group.to_sample()]  # the streams `rows` drew for, in its order
        group.append_timestep({k: token for k, (token, _) in zip(streams, picks)})
        outputs = []
        for k, (token, logprob) in zip(streams, picks):
            outputs.append(self._emit(k, token, group.generated[k], logprob, now))
            group.finished[k] = self.samples[k].finish
        if self.done():
            self._finish(now)
        return outputs


def _matcher(ctx: RequestContext, params: SamplingParams, prompt_ids) -> Matcher | None:
    if params.structured_outputs is None:
        return None
    if ctx.grammars is None:
        raise ValueError("this engine takes no structured outputs (RequestContext.grammars is None)")
    return ctx.grammars.matcher(params.structured_outputs, params.structured_after_thinking, prompt_ids)


def _text(ctx: RequestContext, params: SamplingParams) -> StreamingText:
    return StreamingText(
        ctx.tokenizer, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
    )
