"""A named process group, and the per-process byte counters every collective reports to."""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch.distributed as dist


@dataclass(frozen=True)
class CommGroup:
    """A named group of global ranks; `pg` is None when the group has one rank (no communication)."""

    name: str
    ranks: tuple[int, ...]
    pg: dist.ProcessGroup | None
    global_rank: int
    # what a traced collective (a custom op, which takes strings, not objects) names the group by:
    # unique per group object, so two meshes' groups of the same ranks never mix
    key: str = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", f"{self}@{id(self):x}")
        _BY_KEY[self.key] = self

    @staticmethod
    def by_key(key: str) -> CommGroup:
        """The live group `key` names (traced collectives run on it)."""
        return _BY_KEY[key]

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """Position in sorted global-rank order (torch.distributed's group rank)."""
        return self.ranks.index(self.global_rank)

    def __str__(self) -> str:
        return f"{self.name}{list(self.ranks)}"


_BY_KEY: weakref.WeakValueDictionary[str, CommGroup] = weakref.WeakValueDictionary()
SINGLE = CommGroup("single", (0,), None, 0)


class CommCounters:
    """Bytes and calls per (op, group name) on this process, for volume tests and the ledger.

    Convention: the bytes of one call are the bytes of this rank's input tensor to the collective.
    """

    def __init__(self) -> None:
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    def record(self, op: str, group: CommGroup, nbytes: int) -> None:
        self.bytes[(op, group.name)] += nbytes
        self.calls[(op, group.name)] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {
            f"{op}/{group}": {"bytes": self.bytes[(op, group)], "calls": self.calls[(op, group)]}
            for op, group in sorted(self.bytes)
        }


counters = CommCounters()
