"""The one simulator: time any schedule from per-action costs.

Each rank runs its (lowered) action list in order; an action starts when the rank is free and its
inputs exist: F(s, j) needs F(s-1, j) (through RECV_F when on another rank), I/B(s, j) needs F(s, j)
and I/B(s+1, j), W(s, j) needs I(s, j). Sends and GRAD_SYNC are asynchronous: they take no rank time
and a message lands `p2p + bytes * seconds_per_byte` after its send. Start times are the longest path
through this DAG. Which action can run when does not depend on the costs, so each schedule's DAG is
built once (`_graph`: a worklist of ranks, each blocked on at most one missing dependency, finds an
order of the actions and any deadlock, reported with every rank's blocked action) and every
simulation is one pass over that order: O(total actions). The planner simulates a schedule under
many costs (`plan train` for a 70B model on 64 GPUs: 172 simulations of 19 schedules, 20 s -> 4.4 s
with the DAG kept).

bubble_fraction = 1 - busy / (p * makespan), busy = the total compute time over all ranks.
peak_activations[r] = the most stage-chunk activations rank r holds at once: one is taken by F and
released by B, or by W when the backward is split (Qi et al. 2023, Sec. 2).
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from shiftlm.pipeline.actions import COMPUTE_KINDS, Action, Kind, Schedule, split_keys
from shiftlm.pipeline.lowering import lower

Cost = float | Sequence[float]
Key = tuple[Kind, int, int | None, int]


class DeadlockError(RuntimeError):
    """No rank can run its next action."""


@dataclass(frozen=True)
class ActionCosts:
    """Seconds per stage-chunk and micro-batch; each field a float or a sequence indexed by stage.

    A full backward B costs backward_input + backward_weight unless `backward` says otherwise (it can
    cost less: an executor whose W re-walks the graph pays for part of the backward twice). The forward
    of a micro-batch the schedule splits into I + W costs `split_forward` where given (the trainer runs
    such micro-batches' blocks eagerly under `train.compile`: model/compile.py); I and W only exist for
    those. A message costs p2p seconds plus activation_bytes * seconds_per_byte; activation_bytes is a
    stage's output size.
    """

    forward: Cost = 1.0
    backward_input: Cost = 1.0
    backward_weight: Cost = 1.0
    p2p: Cost = 0.0
    activation_bytes: Cost = 0.0
    seconds_per_byte: float = 0.0
    backward: Cost | None = None
    split_forward: Cost | None = None


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


def dependencies(action: Action, schedule: Schedule) -> list[tuple[Key, bool]]:
    """The actions that must finish before `action` starts, each with whether a message sits between.
    A dependency on I stands for the stage's backward: I, or B where the stage runs a full backward."""
    return _dependencies(action, schedule.lowered, _rank_table(schedule))


def _rank_table(schedule: Schedule) -> list[list[int]]:
    """The placement as a table: `[replica][stage]` -> rank."""
    placement = schedule.placement
    return [[placement.rank_of(s, r) for s in range(schedule.num_stages)] for r in range(placement.replicas)]


def _dependencies(action: Action, lowered: bool, rank_of: list[list[int]]) -> list[tuple[Key, bool]]:
    """The actions that must finish before `action` starts, each with whether a message sits between
    (`rank_of[replica][stage]`: the placement as a table).

    Stage order is 0..S-1 within a replica; W's own F and I precede it on the same rank. A dependency
    on I stands for the stage's backward: I, or B where the stage runs a full backward.
    """
    kind, stage, mb, replica = action.kind, action.stage, action.microbatch, action.replica
    ranks = rank_of[replica]
    if kind is Kind.F:
        if stage == 0:
            return []
        if ranks[stage - 1] == ranks[stage]:
            return [((Kind.F, stage - 1, mb, replica), False)]
        return (
            [((Kind.RECV_F, stage, mb, replica), False)]
            if lowered
            else [((Kind.F, stage - 1, mb, replica), True)]
        )
    if kind in (Kind.B, Kind.I):
        deps = [((Kind.F, stage, mb, replica), False)]
        if stage < len(ranks) - 1:
            local_downstream = ranks[stage + 1] == ranks[stage]
            if local_downstream or not lowered:
                deps.append(((Kind.I, stage + 1, mb, replica), not local_downstream))
            else:
                deps.append(((Kind.RECV_B, stage, mb, replica), False))
        return deps
    if kind is Kind.W:
        return [((Kind.I, stage, mb, replica), False)]
    if kind is Kind.RECV_F:
        return [((Kind.SEND_F, stage - 1, mb, replica), True)]
    if kind is Kind.RECV_B:
        return [((Kind.SEND_B, stage + 1, mb, replica), True)]
    if kind is Kind.SEND_F:
        return [((Kind.F, stage, mb, replica), False)]
    if kind is Kind.SEND_B:
        return [((Kind.I, stage, mb, replica), False)]
    return []  # GRAD_SYNC: ordered after the chunk's last backward by its place in the rank's list


# the kinds that take rank time, in the cost table's order; after them, the forwards of the
# micro-batches that are split into I + W (`ActionCosts.split_forward`)
_TIMED = (Kind.F, Kind.B, Kind.I, Kind.W)
_SPLIT_FORWARD = len(_TIMED)
_LIVE = {Kind.F: 1, Kind.B: -1, Kind.W: -1}  # stage-chunk activations taken (F) and released (B, W)


@dataclass(frozen=True)
class _Graph:
    """A schedule as a DAG, built once per schedule (the planner simulates each under many costs).

    The actions are numbered rank by rank; an action depends on the one before it on its rank and on
    `deps` (each resolved to its number, with the stage whose message sits between, or -1). Which
    action can run when does not depend on the costs, so one cost-free pass finds an order in which
    every action comes after its dependencies (`order`), each rank's peak of live activations, and any
    deadlock; simulating is then one pass over `order`."""

    actions: tuple[Action, ...]
    rank_actions: tuple[range, ...]  # each rank's action numbers, in its order
    deps: tuple[tuple[tuple[int, int], ...], ...]  # (dependency, sending stage or -1: no message)
    previous: tuple[int, ...]  # the action before on the same rank; -1 for a rank's first
    order: tuple[int, ...]  # every action after its dependencies
    cost_slot: tuple[int, ...]  # kind * stages + stage in the cost table (_TIMED order); -1: takes no time
    peak: tuple[int, ...]  # per rank
    sends: tuple[int, ...]  # the SEND actions' numbers, in `order`


def _graph(schedule: Schedule) -> _Graph:
    stages, rank_of = schedule.num_stages, _rank_table(schedule)
    actions: list[Action] = []
    number: dict[Key, int] = {}
    rank_actions, previous = [], []
    for rank, listed in enumerate(schedule.ranks):
        rank_actions.append(range(len(actions), len(actions) + len(listed)))
        for action in listed:
            key = (action.kind, action.stage, action.microbatch, action.replica)
            if key in number:
                raise ValueError(f"rank {rank} runs {action} twice; every action must appear once")
            previous.append(len(actions) - 1 if len(actions) > rank_actions[-1].start else -1)
            number[key] = len(actions)
            actions.append(action)
    deps = []
    for action in actions:
        resolved = []
        for key, via_message in _dependencies(action, schedule.lowered, rank_of):
            found = number.get(key, -1)
            if found < 0 and key[0] is Kind.I:
                found = number.get((Kind.B, *key[1:]), -1)  # the stage ran a full backward
            resolved.append((found, key[1] if via_message else -1))  # a message is timed by its sender
        deps.append(tuple(resolved))

    # the cost-free pass: a worklist of ranks, each blocked on at most one missing dependency
    done = [False] * len(actions)
    order: list[int] = []
    position = [0] * len(rank_actions)
    waiting: dict[int, list[int]] = defaultdict(list)
    runnable = deque(range(len(rank_actions)))
    while runnable:
        rank = runnable.popleft()
        numbers = rank_actions[rank]
        while position[rank] < len(numbers):
            index = numbers[position[rank]]
            missing = next((dep for dep, _ in deps[index] if dep < 0 or not done[dep]), None)
            if missing is not None:
                if missing >= 0:  # a dependency no action produces never wakes the rank: deadlock
                    waiting[missing].append(rank)
                break
            done[index] = True
            order.append(index)
            position[rank] += 1
            runnable.extend(other for other in waiting.pop(index, ()) if other != rank)
    stuck = [
        f"rank {r} waits at {schedule.ranks[r][position[r]]}"
        for r in range(len(rank_actions))
        if position[r] < len(rank_actions[r])
    ]
    if stuck:
        raise DeadlockError(f"schedule {schedule.name!r} deadlocks: " + "; ".join(stuck))

    split = split_keys(actions)
    peak = []
    for numbers in rank_actions:
        live = most = 0
        for index in numbers:
            live += _LIVE.get(actions[index].kind, 0)
            most = max(most, live)
        peak.append(most)
    return _Graph(
        actions=tuple(actions),
        rank_actions=tuple(rank_actions),
        deps=tuple(deps),
        previous=tuple(previous),
        order=tuple(order),
        cost_slot=tuple(_cost_slot(a, split, stages) for a in actions),
        peak=tuple(peak),
        sends=tuple(i for i in order if actions[i].kind in (Kind.SEND_F, Kind.SEND_B)),
    )


def _cost_slot(action: Action, split: set[tuple[int, int, int]], stages: int) -> int:
    """`action`'s row * stages + stage in the cost table; -1 where it takes no rank time."""
    if action.kind not in _TIMED:
        return -1
    if action.kind is Kind.F and (action.stage, action.microbatch, action.replica) in split:
        return _SPLIT_FORWARD * stages + action.stage
    return _TIMED.index(action.kind) * stages + action.stage


# keep the last graphs, by schedule identity (the schedule is held too, so that its id is not reused)
_GRAPHS: OrderedDict[int, tuple[Schedule, _Graph]] = OrderedDict()
_GRAPHS_KEPT = 64


def _graph_of(schedule: Schedule) -> _Graph:
    kept = _GRAPHS.get(id(schedule))
    if kept is not None and kept[0] is schedule:
        _GRAPHS.move_to_end(id(schedule))
        return kept[1]
    graph = _graph(schedule)
    _GRAPHS[id(schedule)] = (schedule, graph)
    if len(_GRAPHS) > _GRAPHS_KEPT:
        _GRAPHS.popitem(last=False)
    return graph


def simulate(schedule: Schedule, costs: ActionCosts | None = None) -> SimulationResult:
    """Time `schedule` (lowered first if needed) under `costs`; raise DeadlockError if it cannot finish."""
    costs = costs or ActionCosts()
    schedule = lower(schedule)
    num_stages, num_ranks = schedule.num_stages, schedule.pp
    forward = _per_stage(costs.forward, num_stages)
    backward_input = _per_stage(costs.backward_input, num_stages)
    backward_weight = _per_stage(costs.backward_weight, num_stages)
    activation_bytes = _per_stage(costs.activation_bytes, num_stages)
    backward = (
        [i + w for i, w in zip(backward_input, backward_weight)]
        if costs.backward is None
        else _per_stage(costs.backward, num_stages)
    )
    split_forward = forward if costs.split_forward is None else _per_stage(costs.split_forward, num_stages)
    table = forward + backward + backward_input + backward_weight + split_forward  # _TIMED, _SPLIT_FORWARD
    # a message lands this long after its send, by the sending stage
    delay = [
        p + a * costs.seconds_per_byte for p, a in zip(_per_stage(costs.p2p, num_stages), activation_bytes)
    ]
    graph = _graph_of(schedule)
    actions, deps, previous = graph.actions, graph.deps, graph.previous
    cost = [table[slot] if slot >= 0 else 0.0 for slot in graph.cost_slot]

    # the longest path through the DAG: an action starts when its rank is free and its inputs exist
    start = [0.0] * len(actions)
    end = [0.0] * len(actions)
    for index in graph.order:
        before = previous[index]
        ready = end[before] if before >= 0 else 0.0
        for dep, sender in deps[index]:
            done = end[dep] + delay[sender] if sender >= 0 else end[dep]
            if done > ready:
                ready = done
        start[index] = ready
        end[index] = ready + cost[index]

    timelines = [[(start[i], end[i], actions[i]) for i in numbers] for numbers in graph.rank_actions]
    busy = []
    for numbers in graph.rank_actions:
        spent = 0.0
        for index in numbers:
            spent += cost[index]
        busy.append(spent)
    rank_time = [end[numbers[-1]] if numbers else 0.0 for numbers in graph.rank_actions]
    makespan = max(rank_time) if num_ranks else 0.0
    total_busy = sum(busy)
    chunks = schedule.placement.chunks  # a chunk holds 1/(p*chunks) of one model replica
    return SimulationResult(
        makespan=makespan,
        bubble_fraction=1.0 - total_busy / (num_ranks * makespan) if makespan > 0 else 0.0,
        peak_activations=list(graph.peak),
        peak_memory=[count / chunks for count in graph.peak],
        timelines=timelines,
        messages=len(graph.sends),
        message_bytes=sum(activation_bytes[actions[index].stage] for index in graph.sends),
        busy=busy,
    )
