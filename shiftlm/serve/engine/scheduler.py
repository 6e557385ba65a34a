"""Continuous batching with chunked prefill, preemption by recompute, and the Shift Parallelism policy.

Every step the scheduler fills a token budget (Orca-style iteration-level scheduling, Yu et al.,
OSDI 2022; chunked prefill as in Sarathi-Serve, Agrawal et al., OSDI 2024): running sequences first,
oldest first (each decode costs one token, an unfinished prefill a chunk of what is left), then waiting
sequences in arrival order. When the cache has no free block for a running sequence, the newest running
sequence is preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed later (vLLM's recompute preemption; its full blocks usually survive in the prefix cache).

The policy picks the parallel mode of the step from the number of scheduled tokens (docs/design.md, "Shift
Parallelism"): full TP for small steps (latency), SP x TP for large ones (throughput). This module
imports no torch: the serving simulator runs this same scheduler with a cost-model runner.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from shiftlm.serve.engine.kv_blocks import BlockManager
from shiftlm.serve.engine.sequence import FinishReason, Sequence, SequenceStatus
from shiftlm.serve.engine.speculative import SpeculativeConfig, make_proposer
from shiftlm.serve.plan import PENDING, Mode, ScheduledChunk, StepPlan


@dataclass(frozen=True)
class ShiftPolicy:
    """Full TP when a step schedules <= `threshold` tokens, else SP x TP."""

    threshold: float

    def mode_for(self, scheduled_tokens: int) -> Mode:
        return Mode.TP if scheduled_tokens <= self.threshold else Mode.SP_TP

    @classmethod
    def named(cls, name: str, threshold: int = 64) -> ShiftPolicy:
        """`tp` and `sp_tp` pin one mode; `shift` switches at `threshold` scheduled tokens."""
        thresholds = {"tp": math.inf, "sp_tp": -1, "shift": threshold}
        if name not in thresholds:
            raise ValueError(f"unknown mode {name!r}; choose one of {sorted(thresholds)}")
        return cls(thresholds[name])


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_tokens_per_step: int = 256
    max_model_len: int = 2048
    policy: ShiftPolicy = ShiftPolicy(64)
    enable_prefix_caching: bool = True
    speculative: SpeculativeConfig | None = None  # draft and verify decodes (engine/speculative.py)
    # fcfs: arrival order; priority: lowest `SamplingParams.priority` first, then arrival (vLLM's)
    scheduling_policy: str = "fcfs"

    @property
    def cache_tokens(self) -> int:
        """Tokens the KV cache holds (each rank holds them all, for its share of the heads)."""
        return self.num_blocks * self.block_size

    def __post_init__(self) -> None:
        if self.max_model_len > self.cache_tokens:
            raise ValueError(
                f"max_model_len {self.max_model_len} does not fit in {self.num_blocks} blocks of "
                f"{self.block_size} tokens; lower max_model_len or raise num_blocks"
            )


@dataclass
class SchedulerStats:
    steps: int = 0
    mode_switches: int = 0
    preemptions: int = 0
    steps_per_mode: dict[str, int] = field(default_factory=lambda: {mode.value: 0 for mode in Mode})


def _rank(seq: Sequence) -> tuple[int, int]:
    """Priority order: lower `priority` first, then arrival (sequence ids count up)."""
    return seq.params.priority, seq.seq_id


class Scheduler:
    """Owns the waiting queue, the running list and the block tables."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()
        self._by_id: dict[int, Sequence] = {}
        self._last_mode: Mode | None = None
        self._free_rows: list[int] = []  # batch rows given back, reused lowest first
        self._num_rows = 0
        self.proposer = None if config.speculative is None else make_proposer(config.speculative)

    def _take_row(self, seq: Sequence) -> None:
        seq.row = heapq.heappop(self._free_rows) if self._free_rows else self._num_rows
        self._num_rows = max(self._num_rows, seq.row + 1)

    def _give_row(self, seq: Sequence) -> None:
        if seq.row >= 0:
            heapq.heappush(self._free_rows, seq.row)
            seq.row = -1

    def add(self, seq: Sequence) -> None:
        if seq.context_len >= self.config.max_model_len:
            raise ValueError(f"sequence of {seq.context_len} tokens exceeds {self.config.max_model_len}")
        self._by_id[seq.seq_id] = seq
        self._wait(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def sequence(self, seq_id: int) -> Sequence | None:
        return self._by_id.get(seq_id)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark `seq` finished and give back its blocks (wherever it is queued)."""
        seq.finish(reason)
        self.blocks.release(seq)
        if self.proposer is not None:
            self.proposer.finished(seq)
        self._give_row(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._by_id.pop(seq.seq_id, None)

    def schedule(self, ahead: bool = False) -> StepPlan | None:
        """The next step's plan. `ahead`: the previous step is still running (asynchronous scheduling,
        engine/core.py): its sampled tokens are `PENDING` in this plan, a sequence whose pending token
        is its last by length is left out, and nothing is preempted (a running sequence the cache
        cannot grow waits, and so does the queue); the engine schedules without `ahead` once that step
        is done."""
        budget = self.config.max_tokens_per_step
        chunks: list[ScheduledChunk] = []
        spec = self.config.speculative
        drafting = spec is not None and (
            spec.disable_by_batch_size is None or len(self.running) <= spec.disable_by_batch_size
        )
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = 0 if seq.last_pending_token(self.config.max_model_len) else seq.chunk_len(budget)
            if num_new == 0:  # a stream group whose timestep does not fit the budget left
                index += 1
                continue
            # drafts take only the budget that every later running sequence's next token leaves
            drafts = self._drafts(seq, num_new, budget - (len(self.running) - index - 1)) if drafting else []
            while not self.blocks.allocate(seq, seq.num_computed + num_new + len(drafts)):
                if drafts:  # a draft gives way before anything is preempted
                    drafts = []
                    continue
                if ahead:  # never free blocks the running step may still write
                    preempted = True
                    break
                self._preempt(self._victim(index))
                preempted = True
                if self.running[index : index + 1] != [seq]:
                    break  # seq preempted itself: nothing newer was left to make room
            else:
                chunks.append(self._chunk(seq, num_new, drafts))
                budget -= num_new + len(drafts)
                index += 1
                continue
            if ahead:
                break
        # Admitting new work while evicting running work would thrash; wait for the next step.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.params.prompt_logprobs is None:  # prompt logprobs need every prompt row computed
                self.blocks.reuse_cached_prefix(seq)
            num_new = seq.chunk_len(budget)
            if num_new == 0:
                self.blocks.release(seq)
                break
            # Keep one free block per running sequence so that decodes do not preempt at once.
            headroom = len(self.running)
            if (
                self.blocks.blocks_needed(seq, seq.num_computed + num_new) + headroom
                > self.blocks.allocator.num_free
            ):
                self.blocks.release(seq)
                break
            self.blocks.allocate(seq, seq.num_computed + num_new)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self._take_row(seq)
            self.running.append(seq)
            chunks.append(self._chunk(seq, num_new))
            budget -= num_new
        if not chunks:
            return None
        return self._plan(tuple(chunks))

    def complete_step(self, plan: StepPlan) -> list[Sequence]:
        """Record that the plan's K/V are now cached (their blocks may go to the prefix cache); return
        the sequences whose logits were sampled, leaving out those finished since it was scheduled."""
        sampled = []
        for chunk in plan.chunks:
            seq = self._by_id.get(chunk.seq_id)
            end = chunk.start + len(chunk.token_ids) - chunk.draft  # drafts are not its tokens (yet)
            if seq is None or seq.num_computed < end:
                continue  # finished or preempted (recomputed from scratch) since
            self.blocks.commit_computed_blocks(seq, end)
            if chunk.sample:
                sampled.append(seq)
        return sampled

    def _drafts(self, seq: Sequence, num_new: int, budget: int) -> list[int]:
        """Tokens drafted to follow a decoding sequence's next one (speculative decoding), within
        `budget` (its token included), its max_tokens and the context; [] when it does not speculate."""
        if (
            num_new != 1
            or seq.num_uncomputed != 1
            or seq.num_pending
            or seq.num_computed < len(seq.prompt_ids)
            or not seq.may_speculate
        ):
            return []
        limit = min(
            budget - 1,
            seq.params.max_tokens - len(seq.output_ids) - 1,
            self.config.max_model_len - seq.num_tokens - 1,
        )
        return self.proposer.propose(seq, limit)

    def _chunk(self, seq: Sequence, num_new: int, drafts: list[int] = ()) -> ScheduledChunk:
        """The chunk of `seq`'s next `num_new` tokens (and `drafts` after them, every row sampled);
        they count as computed from here on (a later plan starts after them; kept drafts are added when
        their draws are read), their blocks are committed by `complete_step`."""
        start, sent = seq.num_computed, seq.num_blocks_sent
        seq.num_blocks_sent = len(seq.block_ids)
        seq.num_computed = start + num_new
        tags = seq.chunk_tags(start, start + num_new)
        all_logits = seq.params.prompt_logprobs is not None and start < len(seq.prompt_ids)
        argmax_only = seq.params.argmax_only and not all_logits and not tags and seq.num_sampled_rows == 1
        known = tuple(seq.token_ids[start : start + num_new])
        seq.draft_ids = list(drafts)
        return ScheduledChunk(
            seq_id=seq.seq_id,
            token_ids=known + (PENDING,) * (num_new - len(known)) + tuple(drafts),
            start=start,
            new_blocks=tuple(seq.block_ids[sent:]),
            sample=start + num_new == seq.num_tokens,
            all_logits=all_logits,
            first_block=sent,
            row=seq.row,
            sample_rows=seq.num_sampled_rows + len(drafts),
            argmax_only=argmax_only,
            draft=len(drafts),
            **tags,
        )

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        self._give_row(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.stats.preemptions += 1
        self._wait(seq, front=True)

    def _wait(self, seq: Sequence, front: bool = False) -> None:
        """Queue `seq`: at the back (a new one) or the front (preempted) under fcfs; under priority
        by (priority, arrival), where a preempted sequence's arrival puts it before newer equals."""
        if self.config.scheduling_policy != "priority":
            self.waiting.appendleft(seq) if front else self.waiting.append(seq)
            return
        key, at = _rank(seq), len(self.waiting)
        while at > 0 and _rank(self.waiting[at - 1]) > key:
            at -= 1
        self.waiting.insert(at, seq)

    def _victim(self, index: int) -> Sequence:
        """Whom to preempt for `running[index]`'s blocks: the newest running sequence (fcfs), or the
        least urgent (priority), among those this step has not scheduled yet (their chunks stand)."""
        if self.config.scheduling_policy != "priority":
            return self.running[-1]
        return max(self.running[index:], key=_rank)

    def _plan(self, chunks: tuple[ScheduledChunk, ...]) -> StepPlan:
        num_tokens = sum(len(chunk.token_ids) for chunk in chunks)
        mode = self.config.policy.mode_for(num_tokens)
        if self._last_mode is not None and mode is not self._last_mode:
            self.stats.mode_switches += 1
        self._last_mode = mode
        self.stats.steps_per_mode[mode.value] += 1
        plan = StepPlan(step=self.stats.steps, mode=mode, chunks=chunks)
        self.stats.steps += 1
        return plan
