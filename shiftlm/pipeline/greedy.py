"""A greedy list scheduler that turns a placement and a memory cap into per-rank action orders.

This is the heuristic of Qi et al. 2023 (Sec. 4, "automatic scheduling") with unit costs
(T_F = T_I = T_W = 1, a full B = 2): whenever a rank is free it runs, in this priority,
  1. a backward (I, or B when the backward is not split) whose gradient has arrived: it is on the
     critical path;
  2. a forward whose input has arrived, if fewer than `cap` stage-chunk activations are held;
  3. the oldest deferred W: weight gradients fill what would otherwise be bubbles.
Ties go to the deeper stage, then the older micro-batch. The result is an order only; the simulator
re-times it under any costs. Because every order comes from an execution that respects every
dependency, the schedule cannot deadlock.
"""

from __future__ import annotations

import heapq
from collections import defaultdict

from shiftlm.pipeline.actions import Action, Kind, Placement, replica_of

UNIT_COST = {Kind.F: 1, Kind.I: 1, Kind.W: 1, Kind.B: 2}


def greedy_order(
    placement: Placement,
    microbatches: int,
    caps: list[int],
    split_backward: bool,
    grad_sync: bool = False,
    latency: float = 0.0,
) -> list[list[Action]]:
    """Per-rank orders; with `grad_sync`, GRAD_SYNC(stage, replica) follows the chunk's last backward.
    `latency`: time a message between two ranks takes (in units of one F); an action whose input
    comes from another rank becomes ready that much after its producer ends, so a rank fills the gap
    with other work where it has some (a schedule that leaves slack before every remote dependency)."""
    last = placement.num_stages - 1
    backward_kind = Kind.I if split_backward else Kind.B
    queues: dict[tuple[int, int], list[int]] = defaultdict(list)  # (stage, replica) -> its micro-batches
    for j in range(microbatches):
        for stage in range(placement.num_stages):
            queues[(stage, replica_of(j, microbatches, placement.replicas))].append(j)
    held = [placement.stages_of(rank) for rank in range(placement.pp)]
    next_forward = defaultdict(int)
    next_backward = defaultdict(int)
    finished: dict[tuple[Kind, int, int, int], int] = {}  # (F or backward, stage, mb, replica) -> end
    live = [0] * placement.pp
    deferred_w: list[list[Action]] = [[] for _ in range(placement.pp)]
    orders: list[list[Action]] = [[] for _ in range(placement.pp)]
    remaining = [
        sum(len(queues[chunk]) for chunk in chunks) * (3 if split_backward else 2) for chunks in held
    ]
    ends: list[int] = []  # min-heap of end times, to move an idle rank on to the next event
    free_at = [(0, rank) for rank in range(placement.pp)]
    sleeping: list[int] = []

    def done_by(key: tuple[Kind, int, int, int], time: float, rank: int) -> bool:
        if key not in finished:
            return False
        remote = latency if placement.rank_of(key[1], key[3]) != rank else 0.0
        return finished[key] + remote <= time

    def pick(rank: int, time: int) -> Action | None:
        backwards, forwards = [], []
        for stage, rep in held[rank]:
            queue = queues[(stage, rep)]
            b = next_backward[(stage, rep)]
            if b < len(queue) and b < next_forward[(stage, rep)]:
                j = queue[b]
                if stage == last or done_by((Kind.B, stage + 1, j, rep), time, rank):
                    backwards.append((b, -stage, rep, Action(backward_kind, stage, j, rep)))
            f = next_forward[(stage, rep)]
            if f < len(queue):
                j = queue[f]
                if stage == 0 or done_by((Kind.F, stage - 1, j, rep), time, rank):
                    forwards.append((f, -stage, rep, Action(Kind.F, stage, j, rep)))
        if backwards:
            return min(backwards)[-1]
        if forwards and live[rank] < caps[rank]:
            return min(forwards)[-1]
        return deferred_w[rank].pop(0) if deferred_w[rank] else None

    while free_at:
        time, rank = heapq.heappop(free_at)
        action = pick(rank, time)
        if action is None:
            while ends and ends[0] <= time:  # ranks are served in time order, so these are past
                heapq.heappop(ends)
            if ends:
                heapq.heappush(free_at, (ends[0], rank))
            else:  # nothing is running yet at this time: wake up when something is
                sleeping.append(rank)
            continue
        end = time + UNIT_COST[action.kind]
        heapq.heappush(ends, end)
        if latency:  # a message it sends arrives then: an idle rank looks again at that time too
            heapq.heappush(ends, end + latency)
        for sleeper in sleeping:
            heapq.heappush(free_at, (end, sleeper))
        sleeping.clear()
        orders[rank].append(action)
        remaining[rank] -= 1
        chunk = (action.stage, action.replica)
        if action.kind is Kind.F:
            next_forward[chunk] += 1
            live[rank] += 1
            finished[(Kind.F, action.stage, action.microbatch, action.replica)] = end
        elif action.kind in (Kind.I, Kind.B):
            next_backward[chunk] += 1
            finished[(Kind.B, action.stage, action.microbatch, action.replica)] = end
            if action.kind is Kind.I:
                deferred_w[rank].append(Action(Kind.W, action.stage, action.microbatch, action.replica))
        if action.kind in (Kind.B, Kind.W):
            live[rank] -= 1
            last_of_chunk = next_backward[chunk] == len(queues[chunk]) and not any(
                (w.stage, w.replica) == chunk for w in deferred_w[rank]
            )
            if grad_sync and last_of_chunk:
                orders[rank].append(Action(Kind.GRAD_SYNC, action.stage, None, action.replica))
        if remaining[rank] > 0:
            heapq.heappush(free_at, (end, rank))
    if sleeping:
        raise RuntimeError(f"greedy scheduler stuck on ranks {sleeping}; caps {caps} are too small")
    return orders
