"""Where the engine and the workers meet: the step plan the scheduler writes and every rank runs.

    plan = StepPlan(step=7, mode=Mode.TP, chunks=(ScheduledChunk(seq_id=3, token_ids=(42,), ...),))
    logits = runner.execute(plan)  # any `Runner`: the model on every rank, or the simulator's cost model

The engine (serve/engine/) imports this module and never a worker's; the workers (serve/worker/)
import it and never the engine's. Imports no torch, so the serving simulator shares it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol


# The parallel mode of one step, and the mode names `--mode` takes (`shift` switches per step).
class Mode(str, enum.Enum):
    TP = "tp"  # all P ranks on every token, weights sharded P ways
    SP_TP = "sp_tp"  # tokens split SP ways, weights TP ways, Ulysses all-to-all around attention


MODE_NAMES = ("tp", "sp_tp", "shift")

# A chunk's token that the previous step is still drawing (asynchronous scheduling, engine/core.py):
# the runner takes it from that step's sampled tokens on the device, in the plan's order of PENDINGs.
PENDING = -1


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens [start, start + len(token_ids)) of one sequence; `sample`: the last row's logits are
    wanted (a token is drawn); `all_logits`: every row's logits are wanted (prompt logprobs).

    The block table travels incrementally: `row` is the sequence's batch row (stable while it runs),
    `new_blocks` the physical blocks appended to its table since its previous chunk, at logical index
    `first_block` (everything, from 0, on a sequence's first chunk after admission). The runner keeps
    the tables as one tensor and applies these deltas, so no step rebuilds a table from a list."""

    seq_id: int
    token_ids: tuple[int, ...]
    start: int
    new_blocks: tuple[int, ...]
    sample: bool
    all_logits: bool = False
    first_block: int = 0
    row: int = 0
    sample_rows: int = 1  # with `sample`: logits of the last rows wanted (a stream group's timestep)
    layout: int = 0  # a stream group's visibility layout (model/stream_mask.py), 0: causal
    prompt_len: int = 0  # stream groups: the shared prompt's length
    argmax_only: bool = False  # with `sample`: only the argmax is needed (SamplingParams.argmax_only)
    streams: tuple[int, ...] = ()  # stream groups: each token's stream (-1: prompt) ...
    positions: tuple[int, ...] = ()  # ... and position
    # speculative decoding: the last `draft` tokens are drafts, computed past the sequence's tokens
    # and kept only as far as the draws agree (every one of the chunk's rows is sampled)
    draft: int = 0

    @property
    def num_logits_rows(self) -> int:
        return len(self.token_ids) if self.all_logits else self.sample_rows * self.sample


@dataclass(frozen=True)
class StepPlan:
    """One engine step: what the runner computes, on every rank, in which mode."""

    step: int
    mode: Mode
    chunks: tuple[ScheduledChunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(chunk.token_ids) for chunk in self.chunks)

    @property
    def num_samples(self) -> int:
        """Rows of logits the step returns (one per sampled chunk, every row of an `all_logits` one)."""
        return sum(chunk.num_logits_rows for chunk in self.chunks)


class Runner(Protocol):
    """What the engine needs of the model: one step's logits."""

    def execute(self, plan: StepPlan, pending: Any = None) -> Any:
        """Logits [plan.num_samples, vocab] for the chunks with `sample=True`, in plan order (a torch
        tensor on the serving ranks; the simulator's runner returns its own stand-in). `pending`: the
        plan's `PENDING` tokens, in order, as a tensor on the runner's device (only passed to a runner
        whose `runs_ahead` is true)."""
