"""The one validator: every compute action exactly once, on the right rank, and no deadlock.

Checks, for every (stage, micro-batch) of the micro-batch's replica: one F, then either one B or one
I followed by one W, all on the rank the placement gives that stage. Dependency order across ranks and
deadlock-freedom (including a W placed before its own I) are checked by running the schedule through the simulator's dependency engine, which
raises DeadlockError naming the action every stuck rank waits at.
"""

from __future__ import annotations

from collections import Counter

from shiftlm.pipeline.actions import COMPUTE_KINDS, Kind, Schedule
from shiftlm.pipeline.simulator import simulate


class ScheduleError(ValueError):
    """A schedule misses, repeats or misplaces an action, or deadlocks."""


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError if `schedule` is not a complete, deadlock-free training step."""
    placement = schedule.placement
    seen: Counter = Counter()
    for rank, actions in enumerate(schedule.ranks):
        for action in actions:
            if action.kind not in COMPUTE_KINDS:
                continue
            owner = placement.rank_of(action.stage, action.replica)
            if owner != rank:
                raise ScheduleError(f"{action} is on rank {rank} but its stage lives on rank {owner}")
            if action.microbatch is None or not 0 <= action.microbatch < schedule.microbatches:
                raise ScheduleError(f"{action} on rank {rank} names no valid micro-batch")
            if schedule.replica_of(action.microbatch) != action.replica:
                raise ScheduleError(f"{action}: micro-batch {action.microbatch} belongs to another replica")
            key = (action.stage, action.microbatch, action.replica)
            seen[(action.kind, *key)] += 1
    for j in range(schedule.microbatches):
        replica = schedule.replica_of(j)
        for stage in range(schedule.num_stages):
            key = (stage, j, replica)
            counts = {kind: seen[(kind, *key)] for kind in COMPUTE_KINDS}
            full, split = counts[Kind.B] == 1, counts[Kind.I] == 1 and counts[Kind.W] == 1
            if counts[Kind.F] != 1 or full == split or sum(counts.values()) != (2 if full else 3):
                detail = ", ".join(f"{kind.value}x{n}" for kind, n in counts.items())
                raise ScheduleError(
                    f"stage {stage} micro-batch {j}: need one F and one B (or one I and one W), got {detail}"
                )
    try:
        simulate(schedule)
    except RuntimeError as err:  # DeadlockError
        raise ScheduleError(str(err)) from err
