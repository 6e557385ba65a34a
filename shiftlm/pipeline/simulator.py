"""The one simulator: time any schedule from per-action costs.

Each rank runs its (lowered) action list in order; an action starts when the rank is free and its
inputs exist: F(s, j) needs F(s-1, j) (through RECV_F when on another rank), I/B(s, j) needs F(s, j)
and I/B(s+1, j), W(s, j) needs I(s, j). Sends and GRAD_SYNC are asynchronous: they take no rank time
and a message lands `p2p + bytes * seconds_per_byte` after its send. Start times are the longest path
through this DAG, found with one pass over the actions (a worklist of ranks, each blocked on at most
one missing dependency), so simulating costs O(total actions). A schedule whose ranks all block is a
deadlock, reported with every rank's blocked action.

bubble_fraction = 1 - busy / (p * makespan), busy = the total compute time over all ranks.
peak_activations[r] = the most stage-chunk activations rank r holds at once: one is taken by F and
released by B, or by W when the backward is split (Qi et al. 2023, Sec. 2).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from shiftlm.pipeline.actions import COMPUTE_KINDS, Action, Kind, Schedule
from shiftlm.pipeline.lowering import lower

Cost = float | Sequence[float]
Key = tuple[Kind, int, int | None, int]


class DeadlockError(RuntimeError):
    """No rank can run its next action."""


@dataclass(frozen=True)
class ActionCosts:
    """Seconds per stage-chunk and micro-batch; each field a float or a sequence indexed by stage.

    A full backward B costs backward_input + backward_weight unless `backward` says otherwise (it can
    cost less: an executor whose W re-walks the graph pays for part of the backward twice). A message
    costs p2p seconds plus activation_bytes * seconds_per_byte; activation_bytes is a stage's output size.
    """

    forward: Cost = 1.0
    backward_input: Cost = 1.0
    backward_weight: Cost = 1.0
    p2p: Cost = 0.0
    activation_bytes: Cost = 0.0
    seconds_per_byte: float = 0.0
    backward: Cost | None = None


@dataclass
class SimulationResult:
    makespan: float
    bubble_fraction: float
    peak_activations: list[int]
    peak_memory: list[float]  # peak_activations / chunks: in activations of one 1/p of the model
    timelines: list[list[tuple[float, float, Action]]]
    messages: int
    message_bytes: float
    busy: list[float] = field(default_factory=list)  # compute seconds per rank

    def idle_inside_span(self, rank: int) -> float:
        """Idle time between the rank's first compute start and its last compute end."""
        spans = [(start, end) for start, end, act in self.timelines[rank] if act.kind in COMPUTE_KINDS]
        return (spans[-1][1] - spans[0][0]) - self.busy[rank] if spans else 0.0


def _per_stage(cost: Cost, num_stages: int) -> list[float]:
    if isinstance(cost, int | float):
        return [float(cost)] * num_stages
    if len(cost) != num_stages:
        raise ValueError(f"a per-stage cost needs {num_stages} values (one per stage), got {len(cost)}")
    return [float(c) for c in cost]


def _key(kind: Kind, action: Action, stage: int | None = None) -> Key:
    return (kind, action.stage if stage is None else stage, action.microbatch, action.replica)


def dependencies(action: Action, schedule: Schedule) -> list[tuple[Key, bool]]:
    """The actions that must finish before `action` starts, each with whether a message sits between.

    Stage order is 0..S-1 within a replica; W's own F and I precede it on the same rank.
    """
    kind, stage, last = action.kind, action.stage, schedule.num_stages - 1
    rank_of = schedule.placement.rank_of
    local_upstream = stage > 0 and rank_of(stage - 1, action.replica) == rank_of(stage, action.replica)
    local_downstream = stage < last and rank_of(stage + 1, action.replica) == rank_of(stage, action.replica)
    if kind is Kind.F:
        if stage == 0:
            return []
        if local_upstream:
            return [(_key(Kind.F, action, stage - 1), False)]
        return (
            [(_key(Kind.RECV_F, action), False)]
            if schedule.lowered
            else [(_key(Kind.F, action, stage - 1), True)]
        )
    if kind in (Kind.B, Kind.I):
        deps = [(_key(Kind.F, action), False)]
        if stage < last:
            if local_downstream or not schedule.lowered:
                # the downstream stage ran either B or I for this micro-batch; resolved by the caller
                deps.append((_key(Kind.I, action, stage + 1), not local_downstream))
            else:
                deps.append((_key(Kind.RECV_B, action), False))
        return deps
    if kind is Kind.W:
        return [(_key(Kind.I, action), False)]
    if kind is Kind.RECV_F:
        return [(_key(Kind.SEND_F, action, stage - 1), True)]
    if kind is Kind.RECV_B:
        return [(_key(Kind.SEND_B, action, stage + 1), True)]
    if kind is Kind.SEND_F:
        return [(_key(Kind.F, action), False)]
    if kind is Kind.SEND_B:
        return [(_key(Kind.I, action), False)]
    return []  # GRAD_SYNC: ordered after the chunk's last backward by its place in the rank's list


def simulate(schedule: Schedule, costs: ActionCosts | None = None) -> SimulationResult:
    """Time `schedule` (lowered first if needed) under `costs`; raise DeadlockError if it cannot finish."""
    costs = costs or ActionCosts()
    schedule = lower(schedule)
    num_stages, num_ranks = schedule.num_stages, schedule.pp
    forward = _per_stage(costs.forward, num_stages)
    backward_input = _per_stage(costs.backward_input, num_stages)
    backward_weight = _per_stage(costs.backward_weight, num_stages)
    p2p = _per_stage(costs.p2p, num_stages)
    activation_bytes = _per_stage(costs.activation_bytes, num_stages)
    duration = {
        Kind.F: forward,
        Kind.B: (
            [i + w for i, w in zip(backward_input, backward_weight)]
            if costs.backward is None
            else _per_stage(costs.backward, num_stages)
        ),
        Kind.I: backward_input,
        Kind.W: backward_weight,
    }

    end: dict[Key, float] = {}
    rank_time = [0.0] * num_ranks
    position = [0] * num_ranks
    live = [0] * num_ranks
    peak = [0] * num_ranks
    busy = [0.0] * num_ranks
    timelines: list[list[tuple[float, float, Action]]] = [[] for _ in range(num_ranks)]
    waiting: dict[Key, list[int]] = defaultdict(list)
    messages, message_bytes = 0, 0.0
    runnable = deque(range(num_ranks))

    while runnable:
        rank = runnable.popleft()
        actions = schedule.ranks[rank]
        while position[rank] < len(actions):
            action = actions[position[rank]]
            start, blocked_on = rank_time[rank], None
            for dep, via_message in dependencies(action, schedule):
                if dep not in end and dep[0] is Kind.I:
                    dep = (Kind.B, *dep[1:])  # the dependency ran as a full backward
                if dep not in end:
                    blocked_on = dep
                    break
                # a message is timed by the stage that sends it
                sender = dep[1]
                delay = (
                    p2p[sender] + activation_bytes[sender] * costs.seconds_per_byte if via_message else 0.0
                )
                start = max(start, end[dep] + delay)
            if blocked_on is not None:
                if blocked_on[0] is Kind.B:  # wake on whichever backward kind runs
                    waiting[(Kind.I, *blocked_on[1:])].append(rank)
                waiting[blocked_on].append(rank)
                break
            kind = action.kind
            cost = duration[kind][action.stage] if kind in duration else 0.0
            finish = start + cost
            key = _key(kind, action)
            if key in end:
                raise ValueError(f"rank {rank} runs {action} twice; every action must appear once")
            end[key] = finish
            rank_time[rank] = finish
            timelines[rank].append((start, finish, action))
            if kind in duration:
                busy[rank] += cost
            if kind is Kind.F:
                live[rank] += 1
                peak[rank] = max(peak[rank], live[rank])
            elif kind in (Kind.B, Kind.W):
                live[rank] -= 1
            elif kind in (Kind.SEND_F, Kind.SEND_B):
                messages += 1
                message_bytes += activation_bytes[action.stage]
            position[rank] += 1
            for other in waiting.pop(key, ()):
                if other != rank:
                    runnable.append(other)
            waiting.pop((Kind.B if kind is Kind.I else Kind.I, *key[1:]), None)

    stuck = [
        f"rank {r} waits at {schedule.ranks[r][position[r]]}"
        for r in range(num_ranks)
        if position[r] < len(schedule.ranks[r])
    ]
    if stuck:
        raise DeadlockError(f"schedule {schedule.name!r} deadlocks: " + "; ".join(stuck))

    makespan = max(rank_time) if num_ranks else 0.0
    total_busy = sum(busy)
    chunks = schedule.placement.chunks  # a chunk holds 1/(p*chunks) of one model replica
    return SimulationResult(
        makespan=makespan,
        bubble_fraction=1.0 - total_busy / (num_ranks * makespan) if makespan > 0 else 0.0,
        peak_activations=peak,
        peak_memory=[count / chunks for count in peak],
        timelines=timelines,
        messages=messages,
        message_bytes=message_bytes,
        busy=busy,
    )
