"""Who is missing from a stuck operation: the hang diagnosis (C4, Dong et al. 2024, sec. 3.2).

Every rank publishes a heartbeat: its progress (operations entered, per group, see
`comm.ledger.progress_key`), the operation it is in now, and the time. When an operation has been
in flight too long, a member entered it iff its progress on that counter is past the operation's
sequence number:

    collective (group g, seq s):     member m entered  <=>  progress_m[g] > s
    recv #s from p on g (at rank a):  p posted the send <=>  progress_p["send:g:a"] > s

A missing member is either dead (its heartbeat stopped), alive outside communication (hung or
very slow in compute), or itself waiting in another operation; in that last case we follow it to
the rank(s) it waits for. The ranks at the end of these chains are the root cause.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from shiftlm.comm.ledger import Record

Heartbeat = dict[str, Any]  # {"rank", "time", "progress": {key: entered}, "pending": PendingOp | None}


def pending_op(record: Record, rank: int, group_ranks: tuple[int, ...]) -> dict[str, Any]:
    """The heartbeat form of an in-flight record."""
    return {
        "rank": rank,
        "op": record.op,
        "group": record.group,
        "ranks": list(group_ranks),
        "seq": record.seq,
        "peer": record.peer,
        "since": record.enter,
    }


def describe(pending: dict[str, Any]) -> str:
    return Record(pending["op"], pending["group"], 0, pending["seq"], 0.0, peer=pending["peer"]).describe(
        pending["ranks"]
    )


def compact_ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2, 5'; [3] -> 'rank 3'."""
    ranks = sorted(ranks)
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def missing_members(pending: dict[str, Any], heartbeats: dict[int, Heartbeat | None]) -> list[int]:
    """The members of `pending`'s operation that have not entered it (by their last heartbeat)."""
    me, seq, group = pending["rank"], pending["seq"], pending["group"]
    if pending["peer"] is None:
        members, key = [r for r in pending["ranks"] if r != me], group
    else:
        counterpart = "recv" if pending["op"] == "send" else "send"
        members, key = [pending["peer"]], f"{counterpart}:{group}:{me}"
    missing = []
    for member in members:
        beat = heartbeats.get(member)
        if beat is None or beat["progress"].get(key, 0) <= seq:
            missing.append(member)
    return missing


@dataclass
class HangDiagnosis:
    rank: int  # the rank whose watchdog fired
    operation: str  # e.g. "all_reduce #812 on group tp[2, 3]"
    waited_s: float
    entered: list[int]  # members that entered (they are waiting), this rank included
    missing: dict[int, str]  # member that never entered -> what it is doing
    root_causes: list[int]

    def message(self) -> str:
        parts = [f"rank {m} never entered {self.operation} ({status})" for m, status in self.missing.items()]
        if not self.missing:
            parts = [f"every member entered {self.operation} but it did not finish (network or library hang)"]
        parts.append(f"{compact_ranks(self.entered)} waited {self.waited_s:.1f} s")
        if self.root_causes and sorted(self.root_causes) != sorted(self.missing):
            parts.append(f"root cause: {compact_ranks(self.root_causes)}")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "missing": {str(r): s for r, s in self.missing.items()},
            "message": self.message(),
        }


def diagnose(
    pending: dict[str, Any], heartbeats: dict[int, Heartbeat | None], now: float, stale_s: float
) -> HangDiagnosis:
    """Name the members missing from `pending` and, following waits, the root-cause rank(s)."""

    def status(rank: int) -> tuple[str, dict[str, Any] | None]:
        beat = heartbeats.get(rank)
        if beat is None:
            return "no heartbeat: dead or never started", None
        if now - beat["time"] > stale_s:
            return f"dead: no heartbeat for {now - beat['time']:.1f} s", None
        if beat.get("pending") is None:
            return "alive, not in a communication op: hung or slow outside communication", None
        return f"alive, waiting in {describe(beat['pending'])}", beat["pending"]

    missing = missing_members(pending, heartbeats)
    root_causes, visited, frontier = [], {pending["rank"]}, list(missing)
    while frontier:
        rank = frontier.pop()
        if rank in visited:
            continue
        visited.add(rank)
        _, waits_in = status(rank)
        if waits_in is None:
            root_causes.append(rank)
        else:
            frontier.extend(missing_members(waits_in, heartbeats))
    members = pending["ranks"] if pending["peer"] is None else [pending["rank"], pending["peer"]]
    return HangDiagnosis(
        rank=pending["rank"],
        operation=describe(pending),
        waited_s=now - pending["since"],
        entered=[r for r in members if r not in missing],
        missing={rank: status(rank)[0] for rank in missing},
        root_causes=sorted(root_causes),
    )
