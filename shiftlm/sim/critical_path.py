"""Critical paths of a simulated pipeline schedule, to re-time it under new costs without simulating.

A schedule's makespan is the longest path through its dependency graph (each rank's action order
plus the stage hand-offs of `shiftlm.pipeline.simulator.dependencies`). The length of any one path is
linear in the costs: how many F, I, W of each stage it crosses, plus how many messages. So for a
fixed path P, `makespan(costs) >= P.length(costs)`, with equality while P stays critical, and the
max over the critical paths of a few simulated cost points is a lower bound on the makespan that is
exact whenever today's critical path is among them. The fitter (validate.py) uses this to evaluate
hundreds of parameter sets on 64-stage x 512-micro-batch schedules in microseconds, and re-simulates
only to collect new paths and to report final numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from shiftlm.pipeline.actions import Action, Kind, Schedule
from shiftlm.pipeline.simulator import SimulationResult, dependencies


@dataclass(frozen=True)
class PathCounts:
    """Per-stage counts of the F, I and W time a path crosses (a full B counts as I + W) and its
    number of messages (every message costs the same `p2p` in the training model)."""

    forward: tuple[int, ...]
    backward_input: tuple[int, ...]
    backward_weight: tuple[int, ...]
    messages: int

    def length(
        self, forward: list[float], backward_input: list[float], backward_weight: list[float], p2p: float
    ) -> float:
        return (
            sum(n * c for n, c in zip(self.forward, forward))
            + sum(n * c for n, c in zip(self.backward_input, backward_input))
            + sum(n * c for n, c in zip(self.backward_weight, backward_weight))
            + self.messages * p2p
        )


def _key(action: Action) -> tuple:
    # the simulator's Key layout: (kind, stage, micro-batch, replica)
    return (action.kind, action.stage, action.microbatch, action.replica)


def critical_path(schedule: Schedule, result: SimulationResult, p2p: float) -> PathCounts:
    """Walk back from the action that ends last: at each step follow the dependency (or the rank's
    previous action) whose end time, plus `p2p` across a message, is exactly this action's start.
    `schedule` must be the lowered schedule that `result` was simulated on with that `p2p`."""
    located = {
        _key(action): (rank, index)
        for rank, timeline in enumerate(result.timelines)
        for index, (_, _, action) in enumerate(timeline)
    }
    tolerance = 1e-9 * result.makespan
    counts = {kind: [0] * schedule.num_stages for kind in (Kind.F, Kind.I, Kind.W)}
    messages = 0
    rank = max(range(len(result.timelines)), key=lambda r: result.timelines[r][-1][1])
    index = len(result.timelines[rank]) - 1
    while True:
        start, _, action = result.timelines[rank][index]
        if action.kind is Kind.B:
            counts[Kind.I][action.stage] += 1
            counts[Kind.W][action.stage] += 1
        elif action.kind in counts:
            counts[action.kind][action.stage] += 1
        if start <= tolerance:
            break
        predecessor = None
        for dep, via_message in dependencies(action, schedule):
            if dep not in located and dep[0] is Kind.I:
                dep = (Kind.B, *dep[1:])  # the upstream ran a full backward
            dep_rank, dep_index = located[dep]
            delay = p2p if via_message else 0.0
            if abs(start - result.timelines[dep_rank][dep_index][1] - delay) <= tolerance:
                predecessor, messages = (dep_rank, dep_index), messages + via_message
                break
        if predecessor is None and index == 0:
            raise RuntimeError(f"no tight predecessor of {action}; was `result` simulated on `schedule`?")
        rank, index = predecessor if predecessor is not None else (rank, index - 1)
    return PathCounts(tuple(counts[Kind.F]), tuple(counts[Kind.I]), tuple(counts[Kind.W]), messages)
