"""Multi-stream generation in the engine: requests of K streams over one shared prompt.

    engine.add_streams("g0", prompt_ids, [prefix_0, prefix_1], [params_0, params_1], layout="timestep")
    for out in engine.step(): out.index  # the stream

The group runs as one sequence (`stream_group.StreamGroup`) in the ordinary continuous batches; its
visibility (`isolated`, `timestep`, `hogwild`) is decoded on every rank from the plan
(`stream_plan.py`, built by `model.stream_mask.stream_visibility`). This module is the engine's side:
checking a request, the sampler rows of each step (every stream its own parameters, generator, stop
strings), appending the next timestep and finishing streams one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from shiftlm.model.stream_mask import LAYOUTS, layout_code
from shiftlm.serve.sampling import SEED_MODULUS, SampleRow, TokenLogprob, make_generator
from shiftlm.serve.sequence import FinishReason, InvalidRequest, SamplingParams
from shiftlm.serve.stream_group import StreamGroup
from shiftlm.serve.text import StreamingText

MAX_STREAMS = 64


@dataclass
class _Group:
    group: StreamGroup
    texts: list[StreamingText]
    generators: list[torch.Generator | None]
    arrival: float
    first_token_time: float | None = None
    outputs: list[object] = field(default_factory=list)


class StreamRequests:
    """The engine's stream groups, by request id (the engine owns the scheduler and the sampler)."""

    def __init__(self, engine):
        self.engine = engine
        self.groups: dict[str, _Group] = {}

    def check(self, prompt_ids, prefixes, params: list[SamplingParams], layout: str) -> int:
        """Raise InvalidRequest naming the problem; return the layout code. No side effects."""
        engine = self.engine
        if layout not in LAYOUTS:
            raise InvalidRequest(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}", "layout")
        if not prefixes:
            raise InvalidRequest("streams is empty; send at least one stream", "streams")
        if len(params) != len(prefixes):
            raise InvalidRequest(
                f"{len(prefixes)} streams but {len(params)} sampling parameter sets", "streams"
            )
        budget = min(MAX_STREAMS, engine.scheduler.config.max_tokens_per_step)
        if len(prefixes) > budget:
            raise InvalidRequest(
                f"too many streams: {len(prefixes)}, this server runs at most {budget} per group "
                "(max tokens per step); send fewer streams",
                "streams",
            )
        for k, (prefix, p) in enumerate(zip(prefixes, params)):
            try:
                p.validate()
            except InvalidRequest as error:
                raise InvalidRequest(f"streams[{k}]: {error}", "streams") from None
            if p.n != 1 or p.prompt_logprobs is not None:
                raise InvalidRequest(f"streams[{k}]: n and echo/prompt logprobs are per request", "streams")
            if not all(0 <= token < engine.vocab_size for token in prefix):
                raise InvalidRequest(
                    f"streams[{k}].prefix token ids must be in [0, {engine.vocab_size})", "streams"
                )
        engine.check_request(prompt_ids, SamplingParams(max_tokens=1))
        for k, (prefix, p) in enumerate(zip(prefixes, params)):
            if len(prompt_ids) + len(prefix) + p.max_tokens > engine.max_model_len:
                raise InvalidRequest(
                    f"streams[{k}]: prompt + prefix + max_tokens = {len(prompt_ids) + len(prefix) + p.max_tokens}"
                    f" tokens, more than the context of {engine.max_model_len}; shorten it",
                    "streams",
                )
        config = engine.scheduler.config
        needed = len(prompt_ids) + sum(len(x) + p.max_tokens for x, p in zip(prefixes, params))
        if needed > config.num_blocks * config.block_size:
            raise InvalidRequest(
                f"too many streams for the cache: the group needs {needed} KV slots (the prompt once, "
                f"every stream's prefix and max_tokens) but the cache holds {config.num_blocks * config.block_size};"
                " send fewer streams, shorter prefixes or a lower max_tokens",
                "streams",
            )
        final = len(prompt_ids) + sum(len(x) + p.max_tokens for x, p in zip(prefixes, params))
        probe = StreamGroup(
            "check", list(prompt_ids), params[0], layout=layout_code(layout), prefixes=tuple(prefixes)
        )
        cost, limit = probe.step_cost(len(prefixes), final), self.max_step_cost()
        if cost > limit:
            raise InvalidRequest(
                f"the group is too costly for one step: its last timestep reads {cost:,} query-key "
                f"scores ({len(prefixes)} streams over up to {final} tokens"
                + (f", x{len(prefixes) + 1} key blocks for hogwild" if layout == "hogwild" else "")
                + f"), more than the step limit of {limit:,} (--max-tokens-per-step x the cache's tokens); "
                "send fewer streams, shorter prefixes or a lower max_tokens",
                "streams",
            )
        window = getattr(getattr(engine.runner, "model_config", None), "sliding_window", None)
        if window is not None:
            raise InvalidRequest("stream groups need a model without a sliding window", "layout")
        return layout_code(layout)

    def max_step_cost(self) -> int:
        """The most query-key scores one group may add to a step: a full step's token budget, each
        token reading the whole cache (what no ordinary step exceeds), so no group slows a step more."""
        config = self.engine.scheduler.config
        return config.max_tokens_per_step * config.num_blocks * config.block_size

    def add_samples(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """OpenAI's n > 1: n `isolated` streams with empty prefixes; sample i draws with seed + i."""
        seeds = [None if params.seed is None else (params.seed + i) % SEED_MODULUS for i in range(params.n)]
        samples = [replace(params, n=1, seed=seed) for seed in seeds]
        self.add(request_id, prompt_ids, [[] for _ in samples], samples, "isolated")

    def add(self, request_id: str, prompt_ids, prefixes, params: list[SamplingParams], layout: str) -> None:
        """Queue a group that `check` has passed."""
        code = layout_code(layout)
        now = self.engine.clock()
        group = StreamGroup.create(
            request_id,
            prompt_ids,
            prefixes,
            params,
            code,
            arrival_time=now,
            max_step_cost=self.max_step_cost(),
        )
        texts = [StreamingText(self.engine.tokenizer, p.stop) for p in params]
        self.groups[request_id] = _Group(group, texts, [make_generator(p, 0) for p in params], now)
        self.engine.scheduler.add(group)
        with self.engine.metrics.lock:
            self.engine.metrics.prompt_tokens += len(prompt_ids) + sum(len(x) for x in prefixes)

    def abort(self, request_id: str) -> bool:
        state = self.groups.pop(request_id, None)
        if state is None:
            return False
        self.engine.scheduler.finish(state.group, FinishReason.ABORT)
        self.engine.metrics.record_finished(FinishReason.ABORT.value)
        return True

    def sample_rows(self, group: StreamGroup, last_row: int) -> tuple[list[SampleRow], list[int]]:
        """The sampler rows of the group's streams that draw now, and which streams they are."""
        state = self.groups[group.request_id]
        first = last_row - group.num_sampled_rows + 1
        rows, streams = [], []
        for k, offset in group.to_sample():
            history = (group.prompt_ids + list(group.prefixes[k]), group.generated[k])
            rows.append(SampleRow(first + offset, group.stream_params[k], state.generators[k], *history))
            streams.append(k)
        return rows, streams

    def advance(self, group: StreamGroup, streams: list[int], drawn, now: float) -> list:
        """Append the next timestep (drawn tokens and prefix tokens); outputs for the drawn tokens."""
        from shiftlm.serve.engine import RequestOutput

        state = self.groups[group.request_id]
        tokens = {k: token for k, (token, _) in zip(streams, drawn)}
        group.append_timestep(tokens)
        outputs = []
        for k, (token, logprob) in zip(streams, drawn):
            outputs.append(self._stream_output(state, k, token, logprob, now, RequestOutput))
        if not group.live():
            del self.groups[group.request_id]
            self.engine.scheduler.finish(group, FinishReason.STOP)
            reasons = {r.value for r in group.finished}
            self.engine.metrics.record_finished(
                FinishReason.LENGTH.value if reasons == {"length"} else "stop"
            )
            with self.engine.metrics.lock:
                self.engine.metrics.e2e.observe(now - state.arrival)
        return outputs

    def _stream_output(self, state: _Group, k: int, token: int, logprob: TokenLogprob | None, now, cls):
        engine, group = self.engine, state.group
        with engine.metrics.lock:
            engine.metrics.generation_tokens += 1
            if state.first_token_time is None:
                state.first_token_time = now
                engine.metrics.ttft.observe(now - state.arrival)
        params, text = group.stream_params[k], state.texts[k]
        delta = text.update(group.generated[k])
        reason = None
        if text.stopped or (token in engine.eos_token_ids and not params.ignore_eos):
            reason = FinishReason.STOP
        elif len(group.generated[k]) >= params.max_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            delta += text.flush()
            group.finished[k] = reason
        return cls(
            request_id=group.request_id,
            index=k,
            text=delta,
            token_ids=[token],
            finish_reason=reason.value if reason else None,
            prompt_tokens=len(group.prompt_ids) + len(group.prefixes[k]),
            completion_tokens=len(group.generated[k]),
            logprobs=logprob,
        )
