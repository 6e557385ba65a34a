"""The one lowering pass: compute-only schedule -> schedule with SEND/RECV actions.

A hand-off between consecutive stages on different ranks becomes a SEND on the producer's rank right
after the producing action and a RECV on the consumer's rank right before the consuming action (the
same action names as torch.distributed.pipelining's `_add_send_recv`: a RECV is named after the stage
that receives). A hand-off between stages on the same rank (the turn of a V placement) gets no
action: the executor passes the tensor in memory, a local copy.

Sends are asynchronous (isend) in the executor and in the simulator, so a rank never blocks on a
send; the only waits are RECVs, each right before the action that needs it. A lowered schedule can
therefore deadlock only if its compute order does, which `validate` checks.
"""

from __future__ import annotations

from dataclasses import replace

from shiftlm.pipeline.actions import Action, Kind, Schedule


def lower(schedule: Schedule) -> Schedule:
    """Insert SEND_F/RECV_F/SEND_B/RECV_B around every cross-rank stage hand-off."""
    if schedule.lowered:
        return schedule
    placement, last_stage = schedule.placement, schedule.num_stages - 1
    lowered_ranks = []
    for rank, actions in enumerate(schedule.ranks):

        def crosses(stage: int, replica: int, rank: int = rank) -> bool:
            return placement.rank_of(stage, replica) != rank

        lowered: list[Action] = []
        for action in actions:
            stage, mb, rep = action.stage, action.microbatch, action.replica
            if action.kind is Kind.F:
                if stage > 0 and crosses(stage - 1, rep):
                    lowered.append(Action(Kind.RECV_F, stage, mb, rep))
                lowered.append(action)
                if stage < last_stage and crosses(stage + 1, rep):
                    lowered.append(Action(Kind.SEND_F, stage, mb, rep))
            elif action.kind in (Kind.B, Kind.I):
                if stage < last_stage and crosses(stage + 1, rep):
                    lowered.append(Action(Kind.RECV_B, stage, mb, rep))
                lowered.append(action)
                if stage > 0 and crosses(stage - 1, rep):
                    lowered.append(Action(Kind.SEND_B, stage, mb, rep))
            else:
                lowered.append(action)
        lowered_ranks.append(tuple(lowered))
    return replace(schedule, ranks=tuple(lowered_ranks), lowered=True)
