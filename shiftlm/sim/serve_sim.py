"""Serving in simulated time: the real `Scheduler` and shift policy replay a trace, a cost model
stands in for the model (docs/design.md, "Simulator and planner": shared code, not a copy).

Each replica is one `shiftlm.serve.engine.scheduler.Scheduler` driven exactly as `Engine.step` drives it:
`schedule()` -> run the plan -> `complete_step(plan)` -> append the sampled token, `finish()` when
the request has its trace output length (the trace forces lengths, as `shiftlm bench serve` does with
ignore_eos). Running the plan advances the replica's clock by `StepCostModel.step_time(plan)`.
Replicas step in the order of their clocks; an arrival is routed (round robin, or to the replica
with the fewest unfinished requests) once every busy replica's clock has passed it.

Metrics follow vLLM's benchmark definitions (as `shiftlm bench serve`): TTFT = first token - arrival
(a calibrated engine adds `ServeHardware.per_request`, the request's path outside the engine, or
`per_request_busy` when it arrives while the engine is stepping);
TPOT = (E2E - TTFT) / (output tokens - 1); goodput = requests per second meeting both SLOs
(DistServe, Zhong et al., OSDI 2024, Sec. 2).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from shiftlm.serve.engine.scheduler import Scheduler, SchedulerConfig, ShiftPolicy
from shiftlm.serve.engine.sequence import FinishReason, SamplingParams, Sequence
from shiftlm.serve.trace import TraceRequest
from shiftlm.sim.serve_runner import (
    IDLE_WAKE_S,
    ServeHardware,
    ServeLayout,
    StepCostModel,
    kv_capacity,
    prefill_chunks,
)

ROUTINGS = ("least_loaded", "round_robin")


class TraceSequence(Sequence):
    """A trace gives lengths, not tokens; with prefix caching off only positions matter, so the
    token ids are their positions (O(1) slices instead of copying the prompt every step)."""

    @property
    def token_ids(self) -> range:  # type: ignore[override]
        return range(self.num_tokens)


@dataclass(frozen=True)
class EngineLimits:
    """Scheduler knobs of every replica (vLLM-like defaults for an H100 node)."""

    block_size: int = 16
    max_num_seqs: int = 256
    max_tokens_per_step: int = 8192
    max_model_len: int | None = None  # default: the longest request in the trace
    num_blocks: int | None = None  # KV blocks per replica; default: what memory leaves (kv_capacity)


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 2.0
    tpot_s: float = 0.1


DEFAULT_LIMITS, DEFAULT_SLO = EngineLimits(), Slo()


@dataclass
class _Timing:
    request: TraceRequest
    first_token: float | None = None
    finish: float | None = None

    @property
    def ttft(self) -> float:
        return self.first_token - self.request.arrival

    @property
    def e2e(self) -> float:
        return self.finish - self.request.arrival

    @property
    def tpot(self) -> float | None:
        out = self.request.output_len
        return (self.finish - self.first_token) / (out - 1) if out > 1 else None


@dataclass
class _Replica:
    scheduler: Scheduler
    cost: StepCostModel
    clock: float = 0.0
    outstanding: int = 0
    idle_for: float = math.inf  # seconds the engine idled before its next step (0 while it steps)


@dataclass
class ServeRun:
    """What one simulated replay produced (times in seconds)."""

    layout: ServeLayout
    timings: list[_Timing]
    steps: int
    mode_switches: int
    preemptions: int
    steps_per_mode: dict[str, int]
    kv_blocks_per_replica: int
    slo: Slo
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        return max(t.finish for t in self.timings) - min(t.request.arrival for t in self.timings)

    @property
    def output_tokens(self) -> int:
        return sum(t.request.output_len for t in self.timings)

    def good(self, timing: _Timing) -> bool:
        tpot = timing.tpot
        return timing.ttft <= self.slo.ttft_s and (tpot is None or tpot <= self.slo.tpot_s)

    def summary(self) -> dict:
        tpots = [t.tpot for t in self.timings if t.tpot is not None]
        span = self.makespan
        input_tokens = sum(t.request.input_len for t in self.timings)
        good = sum(self.good(t) for t in self.timings)
        return {
            "layout": self.layout.name,
            "requests": len(self.timings),
            "ttft_ms": _stats([t.ttft for t in self.timings]),
            "tpot_ms": _stats(tpots),
            "e2e_ms": _stats([t.e2e for t in self.timings]),
            "makespan_s": round(span, 3),
            "requests_per_s": round(len(self.timings) / span, 3),
            "output_tokens_per_s": round(self.output_tokens / span, 1),
            "total_tokens_per_s": round((self.output_tokens + input_tokens) / span, 1),
            "goodput_requests_per_s": round(good / span, 3),
            "slo_attainment": round(good / len(self.timings), 4),
            "slo": {"ttft_ms": 1000 * self.slo.ttft_s, "tpot_ms": 1000 * self.slo.tpot_s},
            "steps": self.steps,
            "mode_switches": self.mode_switches,
            "preemptions": self.preemptions,
            "steps_per_mode": self.steps_per_mode,
            "kv_blocks_per_replica": self.kv_blocks_per_replica,
        }


def _stats(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {}
    values = 1000 * np.asarray(seconds)
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {
        k: round(float(v), 2) for k, v in (("mean", values.mean()), ("p50", p50), ("p90", p90), ("p99", p99))
    }


def scheduler_config(
    setup: ServeHardware, layout: ServeLayout, requests: list[TraceRequest], limits: EngineLimits
) -> SchedulerConfig:
    """The `SchedulerConfig` of one replica: KV blocks from memory, the layout's shift threshold."""
    longest = max(r.input_len + r.output_len for r in requests) + 1
    max_model_len = limits.max_model_len or longest
    capacity = kv_capacity(setup, layout, limits.block_size, limits.max_tokens_per_step)
    num_blocks = limits.num_blocks or capacity.num_blocks
    if num_blocks * limits.block_size < max_model_len:
        raise ValueError(
            f"{layout.name} of {setup.model.name} ({setup.dtype}) leaves KV room for "
            f"{num_blocks * limits.block_size} tokens per replica on {setup.hardware.name}, "
            f"less than the longest request ({max_model_len}); use a larger tp or a bigger GPU"
        )
    if max_model_len < longest:
        raise ValueError(f"--max-model-len {max_model_len} is shorter than a trace request ({longest})")
    return SchedulerConfig(
        num_blocks=num_blocks,
        block_size=limits.block_size,
        max_num_seqs=limits.max_num_seqs,
        max_tokens_per_step=limits.max_tokens_per_step,
        max_model_len=max_model_len,
        # with sp = 1 both modes are the same tp-way step: nothing to shift between, no switches
        policy=ShiftPolicy(layout.threshold if layout.sp > 1 else math.inf),
        enable_prefix_caching=False,  # synthetic prompts share nothing
    )


def simulate_serving(
    setup: ServeHardware,
    layout: ServeLayout,
    requests: list[TraceRequest],
    limits: EngineLimits = DEFAULT_LIMITS,
    slo: Slo = DEFAULT_SLO,
    routing: str = "least_loaded",
    step_log: list[dict] | None = None,
) -> ServeRun:
    """Replay `requests` (arrivals in seconds, sorted) on `layout`; every request runs to completion.
    With `step_log`, every step appends {"mode", "tokens", "chunks", "prefills", "idle", "seconds"}
    to it (`idle`: it started after the engine idled, `HostOverhead.after_idle`)."""
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; choose one of {', '.join(ROUTINGS)}")
    config = scheduler_config(setup, layout, requests, limits)
    replicas = [_Replica(Scheduler(config), StepCostModel(setup, layout)) for _ in range(layout.dp)]
    timings = [_Timing(request) for request in requests]
    pending = deque(zip(itertools.count(), timings))
    round_robin = itertools.cycle(replicas)
    owners: dict[int, _Timing] = {}
    while pending or any(r.scheduler.has_work() for r in replicas):
        busy = [r for r in replicas if r.scheduler.has_work()]
        replica = min(busy, key=lambda r: r.clock) if busy else None
        # the request's path to the engine is slower while the engine steps (it shares the host)
        path = setup.per_request_busy if busy and setup.per_request_busy is not None else setup.per_request
        if pending and (replica is None or pending[0][1].request.arrival + path <= replica.clock):
            index, timing = pending.popleft()
            target = (
                next(round_robin) if routing == "round_robin" else min(replicas, key=lambda r: r.outstanding)
            )
            _admit(target, index, timing, owners, path)
            continue
        _step(replica, owners, step_log)
    schedulers = [r.scheduler for r in replicas]
    steps_per_mode = {
        m: sum(s.stats.steps_per_mode[m] for s in schedulers) for m in schedulers[0].stats.steps_per_mode
    }
    return ServeRun(
        layout=layout,
        timings=timings,
        steps=sum(s.stats.steps for s in schedulers),
        mode_switches=sum(s.stats.mode_switches for s in schedulers),
        preemptions=sum(s.stats.preemptions for s in schedulers),
        steps_per_mode=steps_per_mode,
        kv_blocks_per_replica=config.num_blocks,
        slo=slo,
    )


def _admit(
    replica: _Replica, index: int, timing: _Timing, owners: dict[int, _Timing], path_delay: float
) -> None:
    request = timing.request
    if not replica.scheduler.has_work():  # an idle engine starts when work reaches it
        reached = request.arrival + path_delay
        replica.idle_for = math.inf if replica.idle_for == math.inf else max(0.0, reached - replica.clock)
        replica.clock = max(replica.clock, reached)
    params = SamplingParams(max_tokens=request.output_len, ignore_eos=True)
    seq = TraceSequence(f"r{index}", [0] * request.input_len, params, arrival_time=request.arrival)
    owners[seq.seq_id] = timing
    replica.outstanding += 1
    replica.scheduler.add(seq)


def _step(replica: _Replica, owners: dict[int, _Timing], step_log: list[dict] | None = None) -> None:
    """One engine step, as `Engine.step` does it, with the cost model's time instead of a forward."""
    plan = replica.scheduler.schedule()
    if plan is None:
        raise RuntimeError("the scheduler has work but scheduled nothing; the KV cache is too small")
    idle = replica.idle_for >= IDLE_WAKE_S
    replica.idle_for = 0.0
    seconds = replica.cost.step_time(plan, idle)
    replica.clock += seconds
    if step_log is not None:
        step_log.append(
            {
                "mode": plan.mode.value,
                "tokens": plan.num_tokens,
                "chunks": len(plan.chunks),
                "prefills": prefill_chunks(plan),
                "idle": idle,
                "seconds": seconds,
            }
        )
    for seq in replica.scheduler.complete_step(plan):
        timing = owners[seq.seq_id]
        if timing.first_token is None:
            timing.first_token = replica.clock
        seq.output_ids.append(0)
        if len(seq.output_ids) >= seq.params.max_tokens:
            replica.scheduler.finish(seq, FinishReason.LENGTH)
            timing.finish = replica.clock
            replica.outstanding -= 1
            del owners[seq.seq_id]
