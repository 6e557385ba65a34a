"""The order in which every pair of pipeline ranks exchanges its messages in one step.

NCCL matches the point-to-point operations of two ranks in the order each side posts them (it ignores
tags) and runs them, per pair, one after another on one stream; gloo matches by tag. Code that runs on
both must make the two ranks of a pair post the same sequence: rank a's k-th operation with rank b is
the counterpart (send <-> receive) of b's k-th operation with a. Then no grouping
(`batch_isend_irecv`) is needed either: a send never waits behind a receive whose message its peer can
only send later.

`pair_orders` fixes that sequence once per schedule. It runs the lowered schedule as a discrete-event
simulation of all ranks (unit costs: F, I, W 1, B 2, messages instant; the rank whose next action
can start earliest runs it, ties to the lower rank) and lists each pair's messages in the order they
are sent. That is one sequential execution of the schedule, so a rank that follows it never waits
for a message its peer can send only after a later message of ours: before it must post a send, every
earlier message of the pair was sent by the peer already or is one of its own earlier sends. The
executor posts a send when its action runs and every receive as early as the order lets it (once
every earlier operation of the pair is posted), which is what hides a transfer behind compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from shiftlm.pipeline.actions import Action, Kind, Schedule
from shiftlm.pipeline.lowering import lower

_COST = {Kind.F: 1.0, Kind.B: 2.0, Kind.I: 1.0, Kind.W: 1.0}


@dataclass(frozen=True, slots=True)
class Message:
    """One pipeline message. `kind` "act": the input of `stage` (sent by stage - 1); "grad": the
    gradient w.r.t. `stage`'s output (sent by stage + 1); "sync": BitPipe's gradient sum of `stage`,
    from the replica `replica` (microbatch -1). Ranks are pipeline ranks (0..pp-1)."""

    kind: str
    stage: int
    microbatch: int
    replica: int
    sender: int
    receiver: int

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.stage, self.microbatch, self.replica)


def sent_by(action: Action, schedule: Schedule, rank: int) -> Message | None:
    """The message `action` (a lowered SEND_F / SEND_B / GRAD_SYNC on `rank`) sends, if any."""
    place, mb, rep = schedule.placement, action.microbatch, action.replica
    if action.kind is Kind.SEND_F:
        return Message("act", action.stage + 1, mb, rep, rank, place.rank_of(action.stage + 1, rep))
    if action.kind is Kind.SEND_B:
        return Message("grad", action.stage - 1, mb, rep, rank, place.rank_of(action.stage - 1, rep))
    if action.kind is Kind.GRAD_SYNC:
        peer = place.rank_of(action.stage, 1 - rep)
        return None if peer == rank else Message("sync", action.stage, -1, rep, rank, peer)
    return None


def awaited_by(action: Action, schedule: Schedule, rank: int) -> Message | None:
    """The message a lowered RECV_F / RECV_B on `rank` waits for, if any."""
    place, mb, rep = schedule.placement, action.microbatch, action.replica
    if action.kind is Kind.RECV_F:
        return Message("act", action.stage, mb, rep, place.rank_of(action.stage - 1, rep), rank)
    if action.kind is Kind.RECV_B:
        return Message("grad", action.stage, mb, rep, place.rank_of(action.stage + 1, rep), rank)
    return None


def pair_orders(schedule: Schedule) -> dict[tuple[int, int], list[Message]]:
    """(lower rank, higher rank) -> every message between the two, both directions, in send order."""
    lowered = lower(schedule)
    programs = lowered.ranks
    pp = len(programs)
    position, clock = [0] * pp, [0.0] * pp
    sent_at: dict[Message, float] = {}
    orders: dict[tuple[int, int], list[Message]] = {}
    while True:
        best: tuple[float, int] | None = None
        for rank in range(pp):
            if position[rank] == len(programs[rank]):
                continue
            start = clock[rank]
            awaited = awaited_by(programs[rank][position[rank]], lowered, rank)
            if awaited is not None:
                if awaited not in sent_at:
                    continue
                start = max(start, sent_at[awaited])
            if best is None or start < best[0]:
                best = (start, rank)
        if best is None:
            break
        start, rank = best
        action = programs[rank][position[rank]]
        position[rank] += 1
        clock[rank] = start + _COST.get(action.kind, 0.0)
        message = sent_by(action, lowered, rank)
        if message is not None:
            sent_at[message] = clock[rank]
            orders.setdefault((min(rank, message.receiver), max(rank, message.receiver)), []).append(message)
    stuck = [f"rank {r} at {programs[r][position[r]]}" for r in range(pp) if position[r] < len(programs[r])]
    if stuck:
        raise ValueError(f"schedule {schedule.name} deadlocks: " + ", ".join(stuck))
    return orders


def rank_operations(schedule: Schedule, rank: int) -> dict[int, list[tuple[bool, Message]]]:
    """Peer pipeline rank -> this rank's operations with it in the pair's order: (is_send, message)."""
    operations: dict[int, list[tuple[bool, Message]]] = {}
    for (low, high), messages in pair_orders(schedule).items():
        if rank in (low, high):
            peer = high if rank == low else low
            operations[peer] = [(message.sender == rank, message) for message in messages]
    return operations
