"""Multi-stream generation in the engine: requests of K streams over one shared prompt.

    engine.add_streams("g0", prompt_ids, [prefix_0, prefix_1], [params_0, params_1], layout="timestep")
    for out in engine.step(): out.index  # the stream

The group runs as one sequence (`stream_group.StreamGroup`) in the ordinary continuous batches; its
visibility (`isolated`, `timestep`, `hogwild`) is decoded on every rank from the plan
(`worker/stream_plan.py`, built by `model.stream_mask.stream_visibility`). The group is a request
like any other (`requests.StreamRequest`); this module checks one before it is queued.
"""

from __future__ import annotations

from shiftlm.model.stream_mask import LAYOUTS, layout_code
from shiftlm.serve.engine.errors import InvalidRequest
from shiftlm.serve.engine.scheduler import SchedulerConfig
from shiftlm.serve.engine.sequence import SamplingParams
from shiftlm.serve.engine.stream_group import StreamGroup

__all__ = ["MAX_STREAMS", "check_group_fits", "check_streams", "layout_code", "max_step_cost"]

MAX_STREAMS = 64


def check_streams(engine, prompt_ids, prefixes, params: list[SamplingParams], layout: str) -> int:
    """Raise InvalidRequest naming the problem; return the layout code. No side effects."""
    if layout not in LAYOUTS:
        raise InvalidRequest(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}", "layout")
    if not prefixes:
        raise InvalidRequest("streams is empty; send at least one stream", "streams")
    if len(params) != len(prefixes):
        raise InvalidRequest(f"{len(prefixes)} streams but {len(params)} sampling parameter sets", "streams")
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
    check_group_fits(engine, prompt_ids, prefixes, params, layout, "streams")
    if engine.sliding_window is not None and layout != "isolated":
        raise InvalidRequest(
            f"{layout} stream groups need a model without a sliding window; use layout isolated", "layout"
        )
    return layout_code(layout)


def check_group_fits(
    engine, prompt_ids, prefixes, params: list[SamplingParams], layout: str, param: str
) -> None:
    """Raise InvalidRequest if the group (a /v1/streams group, or a request's n samples) can never
    run: more KV slots than the whole cache (it would preempt itself and recompute forever), or a
    last timestep costlier than any step may be."""
    what = "streams" if param == "streams" else "samples"
    fix = (
        "send fewer streams, shorter prefixes or a lower max_tokens"
        if param == "streams"
        else "lower n or max_tokens"
    )
    config = engine.scheduler.config
    needed = len(prompt_ids) + sum(len(x) + p.max_tokens for x, p in zip(prefixes, params))
    if needed > config.cache_tokens:
        raise InvalidRequest(
            f"too many {what} for the cache: the group needs {needed} KV slots (the prompt once, then "
            + ("every stream's prefix and max_tokens" if param == "streams" else "max_tokens per sample")
            + f") but the cache holds "
            f"{config.cache_tokens} (--num-blocks x --block-size); {fix}",
            param,
        )
    probe = StreamGroup(
        "check", list(prompt_ids), params[0], layout=layout_code(layout), prefixes=tuple(prefixes)
    )
    cost, limit = probe.step_cost(len(prefixes), needed), max_step_cost(config)
    if cost > limit:
        raise InvalidRequest(
            f"the group is too costly for one step: its last timestep reads {cost:,} query-key "
            f"scores ({len(prefixes)} {what} over up to {needed} tokens"
            + (f", x{len(prefixes) + 1} key blocks for hogwild" if layout == "hogwild" else "")
            + f"), more than the step limit of {limit:,} (--max-tokens-per-step x the cache's tokens); {fix}",
            param,
        )


def max_step_cost(config: SchedulerConfig) -> int:
    """The most query-key scores one group may add to a step: a full step's token budget, each
    token reading the whole cache (what no ordinary step exceeds), so no group slows a step more."""
    return config.max_tokens_per_step * config.cache_tokens
