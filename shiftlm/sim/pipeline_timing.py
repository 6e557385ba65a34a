"""A layout's pipeline schedule timed under per-stage costs, memoised: the planner prices thousands of
layouts whose schedules repeat (`pipeline_timing` normalises the costs, so each schedule and cost
ratio is simulated once by `shiftlm.pipeline.simulator.simulate`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from shiftlm.pipeline.peak import lowered_schedule
from shiftlm.sim.layout import Layout


@dataclass(frozen=True)
class StageCosts:
    """Per-stage seconds per micro-batch, and the collective share of them (for the breakdown)."""

    forward: list[float]
    backward_input: list[float]
    backward_weight: list[float]
    comm: list[float]
    p2p: float
    # the costs of the micro-batches a zero-bubble schedule splits into I + W, where they run otherwise
    # (the trainer's compiled blocks run those eagerly: model/compile.py); None: as the rest
    split: StageCosts | None = None


@dataclass(frozen=True)
class PipelineTiming:
    makespan: float
    bubble_fraction: float
    peak_activations: int
    busy: tuple[float, ...]  # compute seconds per rank
    busiest_stages: tuple[int, ...]  # the stages the busiest rank holds


# Ratios are rounded to this many significant digits before memoising: costs within a relative
# 1e-12 of each other give makespans within 1e-12 (the makespan is monotone and homogeneous).
_RATIO_DIGITS = 12


def pipeline_timing(layout: Layout, stage: StageCosts) -> PipelineTiming:
    """Simulate `layout`'s schedule under `stage` costs. A makespan scales linearly when F, I, W and
    p2p scale together, so the costs are normalised by the largest forward and each (schedule,
    costs ratio) is simulated once; the planner's ZeRO variants and re-ranked layouts hit the memo."""
    if layout.pp == 1:  # no pipeline: micro-batches run back to back (gradient accumulation)
        busy = layout.microbatches * (stage.forward[0] + stage.backward_input[0] + stage.backward_weight[0])
        return PipelineTiming(busy, 0.0, 1, (busy,), (0,))
    scale = max(stage.forward)

    def ratios(values: list[float]) -> tuple[float, ...]:
        return tuple(float(f"{v / scale:.{_RATIO_DIGITS}g}") for v in values)

    split = stage.split or stage
    unit = _unit_pipeline_timing(
        layout.schedule,
        layout.pp,
        layout.microbatches,
        layout.chunks,
        ratios(stage.forward),
        # I and W exist only for split micro-batches; a full backward B costs the rest's I + W
        ratios(split.backward_input),
        ratios(split.backward_weight),
        ratios([i + w for i, w in zip(stage.backward_input, stage.backward_weight)]),
        ratios(split.forward),
        ratios([stage.p2p])[0],
    )
    return replace(unit, makespan=unit.makespan * scale, busy=tuple(b * scale for b in unit.busy))


@lru_cache(maxsize=8192)
def _unit_pipeline_timing(
    name: str,
    pp: int,
    microbatches: int,
    chunks: int,
    forward: tuple[float, ...],
    backward_input: tuple[float, ...],
    backward_weight: tuple[float, ...],
    backward: tuple[float, ...],
    split_forward: tuple[float, ...],
    p2p: float,
) -> PipelineTiming:
    from shiftlm.pipeline.simulator import ActionCosts, simulate

    schedule = lowered_schedule(name, pp, microbatches, chunks)
    costs = ActionCosts(
        list(forward),
        list(backward_input),
        list(backward_weight),
        p2p=p2p,
        backward=list(backward),
        split_forward=list(split_forward),
    )
    result = simulate(schedule, costs)
    busiest = max(result.busy)
    rank = result.busy.index(busiest)
    return PipelineTiming(
        result.makespan,
        result.bubble_fraction,
        max(result.peak_activations),
        tuple(result.busy),
        tuple(s for s in range(schedule.num_stages) if schedule.placement.rank_of(s) == rank),
    )
