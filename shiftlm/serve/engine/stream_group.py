"""A stream group as the scheduler sees it: ONE sequence whose tokens are the shared prompt followed
by K streams' tokens interleaved by timestep (`model.stream_mask.interleave`'s order).

Being one sequence, the group is batched, admitted, chunked and preempted (whole) like any other, and
its prompt's blocks are allocated once (and found in, or offered to, the prefix cache; blocks past the
prompt are not, their K/V depend on the layout, not on the tokens alone). Each engine step computes
one timestep: one token per live stream, whose logits give each stream its next token. Stream k's own
prefix occupies its first timesteps (position prompt_len + t); it samples once its prefix is written.
A stream that finishes stops adding tokens; the others go on. Only the sampled rows' logits come back
(`num_sampled_rows`), and a chunk never splits the last timestep, so they are all in one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shiftlm.model.stream_mask import HOGWILD, PROMPT, TIMESTEP
from shiftlm.serve.engine.sequence import FinishReason, SamplingParams, Sequence


@dataclass(eq=False)
class StreamGroup(Sequence):
    layout: int = TIMESTEP
    prefixes: tuple[tuple[int, ...], ...] = ()
    stream_params: tuple[SamplingParams, ...] = ()
    generated: list[list[int]] = field(default_factory=list)  # per stream, sampled tokens only
    finished: list[FinishReason | None] = field(default_factory=list)
    tag_streams: list[int] = field(default_factory=list)  # the stream of each output_ids entry
    tag_times: list[int] = field(default_factory=list)  # and its timestep
    timesteps: int = 0  # timesteps written so far
    last_width: int = 1  # tokens of the last timestep (1 before any: the prompt's last row)
    max_step_cost: int | None = None  # most `step_cost` one step of this group may have (None: any)

    @classmethod
    def create(
        cls, request_id, prompt_ids, prefixes, stream_params, layout, arrival_time=0.0, max_step_cost=None
    ) -> StreamGroup:
        group = cls(
            request_id,
            list(prompt_ids),
            stream_params[0],
            arrival_time=arrival_time,
            layout=layout,
            prefixes=tuple(tuple(p) for p in prefixes),
            stream_params=tuple(stream_params),
            generated=[[] for _ in prefixes],
            finished=[None] * len(prefixes),
            max_step_cost=max_step_cost,
        )
        while group.timesteps < min(len(p) for p in group.prefixes):  # every stream's input is known
            group.append_timestep({})
        return group

    @property
    def num_streams(self) -> int:
        return len(self.prefixes)

    def live(self) -> list[int]:
        return [k for k in range(self.num_streams) if self.finished[k] is None]

    def to_sample(self) -> list[tuple[int, int]]:
        """(stream, row among the last timestep's rows) of each live stream whose next token is drawn."""
        t = self.timesteps
        if t == 0:  # the prompt's last row
            return [(k, 0) for k in self.live() if not self.prefixes[k]]
        writers = self.tag_streams[len(self.tag_streams) - self.last_width :]
        return [(k, writers.index(k)) for k in self.live() if t >= len(self.prefixes[k])]

    def append_timestep(self, drawn: dict[int, int]) -> list[int]:
        """Write timestep t: each live stream's prefix token, or its drawn token; the writers."""
        t, writers = self.timesteps, []
        for k in self.live():
            if t < len(self.prefixes[k]):
                token = self.prefixes[k][t]
            elif k in drawn:
                token = drawn[k]
                self.generated[k].append(token)
            else:
                continue
            self.output_ids.append(token)
            self.tag_streams.append(k)
            self.tag_times.append(t)
            writers.append(k)
        self.timesteps += 1
        self.last_width = len(writers)
        return writers

    def step_cost(self, num_new: int, context: int | None = None) -> int:
        """What computing `num_new` more tokens costs, in query-key scores: each query reads the
        context (`context`, default: the group's after these tokens), and a hogwild query once per
        key block (the prompt and every stream: its per-worker query rotation, issue 35.2)."""
        context = self.num_computed + num_new if context is None else context
        blocks = self.num_streams + 1 if self.layout == HOGWILD else 1
        return blocks * num_new * context

    # Sequence hooks (scheduler.py, kv_blocks.py)
    def chunk_len(self, budget: int) -> int:
        """All that is left, or a prefix chunk that ends before the last timestep (sampled together);
        no more than `max_step_cost` allows, so one group never makes a step slow for the others."""
        left = self.num_uncomputed
        if self.max_step_cost is not None:
            fits = self.max_step_cost // max(1, self.step_cost(1, self.num_tokens))
            budget = min(budget, max(fits, 0))
        if left <= budget:
            return left
        return max(0, min(budget, left - self.num_sampled_rows))

    @property
    def num_sampled_rows(self) -> int:
        return self.last_width

    @property
    def may_speculate(self) -> bool:
        return False  # a timestep is one token per stream

    @property
    def context_len(self) -> int:
        return len(self.prompt_ids) + self.timesteps

    @property
    def num_cacheable(self) -> int:
        return len(self.prompt_ids)

    def chunk_tags(self, start: int, end: int) -> dict:
        p = len(self.prompt_ids)
        first, last = max(start - p, 0), max(end - p, 0)  # the chunk's range in output_ids
        streams = [PROMPT] * max(0, min(end, p) - start) + self.tag_streams[first:last]
        positions = list(range(start, min(end, p))) + [p + t for t in self.tag_times[first:last]]
        return dict(layout=self.layout, prompt_len=p, streams=tuple(streams), positions=tuple(positions))
