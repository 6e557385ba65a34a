"""The collective ledger: what this rank's communication did, and when.

C4 (Dong et al. 2024, "Boosting Large-scale Parallel Training Efficiency with C4", sec. 3.1) observes
that collectives repeat every step and are identical across the ranks of a group, so a per-rank log
of (op, group, bytes, sequence number, enter time, exit time) is enough to name the rank the others
waited for (`shiftlm.monitor.straggler`) or the rank that never came (`shiftlm.monitor.watchdog`).

Every shiftlm comm op calls `ledger.enter(...)` before it talks to the network and `ledger.exit(...)`
when the data is there. Two things happen even while the ledger is off, because both must agree
across ranks whenever it is switched on: the per-group sequence number advances (one dict update),
and the fault-injection hooks run (an empty-list test). Records are kept only while `enabled`, in a
bounded ring buffer, so a long run keeps the last `capacity` operations.

Sequence numbers: a collective's `seq` counts the collectives this rank entered on that group before
it (0-based), so the k-th all-reduce on `tp[2, 3]` has the same seq on ranks 2 and 3. A point-to-point
operation counts per (op, group, peer): the k-th send from a to b matches the k-th receive at b from a.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shiftlm.comm.group import CommGroup

P2P_OPS = ("send", "recv")
DEFAULT_CAPACITY = 8192


def progress_key(op: str, group: str, peer: int | None) -> str:
    """The counter a record advances: the group for a collective, (op, group, peer) for P2P."""
    return group if peer is None else f"{op}:{group}:{peer}"


class Record:
    """One communication operation on this rank; `exit` is None while it is in flight."""

    __slots__ = ("op", "group", "nbytes", "seq", "enter", "exit", "peer", "tag", "async_op")

    def __init__(self, op, group, nbytes, seq, enter, exit=None, peer=None, tag=None, async_op=False):
        self.op, self.group, self.nbytes, self.seq = op, group, nbytes, seq
        self.enter, self.exit = enter, exit
        self.peer, self.tag, self.async_op = peer, tag, async_op

    @property
    def key(self) -> str:
        return progress_key(self.op, self.group, self.peer)

    def row(self) -> list:
        return [
            self.op,
            self.group,
            self.nbytes,
            self.seq,
            self.enter,
            self.exit,
            self.peer,
            self.tag,
            self.async_op,
        ]

    @classmethod
    def from_row(cls, row: list) -> Record:
        return cls(*row)

    def describe(self, group_ranks: tuple[int, ...] | list[int] | None = None) -> str:
        """`all_reduce #812 on group tp[2, 3]` or `recv #4 from rank 1 on group pp[0, 1]`."""
        where = f"group {self.group}{list(group_ranks)}" if group_ranks is not None else f"group {self.group}"
        if self.peer is None:
            return f"{self.op} #{self.seq} on {where}"
        direction = "to" if self.op == "send" else "from"
        return f"{self.op} #{self.seq} {direction} rank {self.peer} on {where}"

    def __repr__(self) -> str:
        return f"Record({self.row()})"


@dataclass
class RankLedger:
    """A frozen copy of one rank's ledger: what the analyses and `shiftlm monitor report` read."""

    rank: int
    groups: dict[str, tuple[int, ...]]
    records: list[Record]
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. the watchdog's hang diagnosis

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "groups": {name: list(ranks) for name, ranks in self.groups.items()},
            "records": [record.row() for record in self.records],
            **self.extra,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankLedger:
        extra = {k: v for k, v in data.items() if k not in ("rank", "groups", "records")}
        groups = {name: tuple(ranks) for name, ranks in data["groups"].items()}
        return cls(int(data["rank"]), groups, [Record.from_row(row) for row in data["records"]], extra)

    def dump(self, directory: str | Path) -> Path:
        """Write `ledger-rank{r}.json` into `directory` (created if needed); return the path."""
        path = Path(directory) / f"ledger-rank{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(".json.tmp")
        staging.write_text(json.dumps(self.to_dict()))
        staging.replace(path)  # a reader never sees half a file, even if we are killed mid-write
        return path


EnterHook = Callable[[str, CommGroup], None]


class CollectiveLedger:
    """This process's ledger (one per process, like `comm.counters`)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.enabled = False
        self.rank: int | None = None
        self.groups: dict[str, tuple[int, ...]] = {}
        self.hooks: list[EnterHook] = []  # run before a rank enters any op (fault injection)
        self._records: deque[Record] = deque(maxlen=capacity)
        self._entered: dict[str, int] = defaultdict(int)  # progress_key -> operations entered
        self._in_flight: dict[int, Record] = {}
        self._lock = threading.Lock()  # the watchdog thread reads while the main thread writes

    def enable(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity != self._records.maxlen:
            self._records = deque(self._records, maxlen=capacity)
        self.enabled = True

    def disable(self) -> None:
        self.enabled = False

    def clear(self) -> None:
        """Forget the records (sequence numbers keep counting: they must stay aligned across ranks)."""
        with self._lock:
            self._records.clear()
            self._in_flight.clear()

    def enter(
        self,
        op: str,
        group: CommGroup,
        nbytes: int,
        peer: int | None = None,
        tag: int | None = None,
        async_op: bool = False,
    ) -> Record | None:
        """Note that this rank starts `op` on `group`; returns the record to pass to `exit` (None when off)."""
        for hook in self.hooks:
            hook(op, group)
        key = progress_key(op, group.name, peer)
        seq = self._entered[key]
        self._entered[key] = seq + 1
        if not self.enabled:
            return None
        record = Record(op, group.name, nbytes, seq, time.time(), None, peer, tag, async_op)
        with self._lock:
            self.rank = group.global_rank
            self.groups[group.name] = group.ranks
            self._records.append(record)
            self._in_flight[id(record)] = record
        return record

    def exit(self, record: Record | None) -> None:
        """Note that `record`'s operation finished on this rank (its data is there)."""
        if record is None or record.exit is not None:
            return
        record.exit = time.time()
        with self._lock:
            self._in_flight.pop(id(record), None)

    def progress(self) -> dict[str, int]:
        """progress_key -> number of operations this rank has entered (the watchdog publishes this)."""
        return dict(self._entered)

    def in_flight(self) -> list[Record]:
        """Operations entered and not finished, oldest first."""
        with self._lock:
            return sorted(self._in_flight.values(), key=lambda record: record.enter)

    def snapshot(self, last: int | None = None) -> RankLedger:
        """A copy of the (last `last`) records, for gathering or dumping."""
        with self._lock:
            records = list(self._records)[-last:] if last else list(self._records)
            copies = [Record.from_row(record.row()) for record in records]
        rank = self.rank
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else -1
        return RankLedger(rank, dict(self.groups), copies)


ledger = CollectiveLedger()


class TrackedWork:
    """An in-flight operation: `wait()` blocks, records the exit time, and returns the result tensor."""

    def __init__(self, work: dist.Work | None, record: Record | None, result: torch.Tensor | None):
        self.work, self.record, self.result = work, record, result

    def wait(self) -> torch.Tensor | None:
        if self.work is not None:
            self.work.wait()
        ledger.exit(self.record)
        return self.result

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


def load_ledger(path: str | Path) -> RankLedger:
    return RankLedger.from_dict(json.loads(Path(path).read_text()))
