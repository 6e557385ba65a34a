"""The pipeline IR: actions, placements and the schedule that holds them.

A schedule is data (as in torch.distributed.pipelining): for every pipeline rank, the ordered list of
actions it runs. An action names a stage (a model chunk), a micro-batch and, for BitPipe's two model
replicas, a replica. The compact string form is PyTorch's `_Action` form, `2F0` = stage 2 forward of
micro-batch 0, `1W3`, `0SEND_F1`, `3GRAD_SYNC`; an action of replica 1 gets the prefix `R1:`.
`write_csv` / `read_csv` use the CSV layout of `torch.distributed.pipelining` (one row per rank).
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path


class Kind(str, Enum):
    """What an action does; the values are torch.distributed.pipelining's `_ComputationType` values."""

    F = "F"  # forward
    B = "B"  # full backward (input and weight gradients together)
    I = "I"  # noqa: E741 - backward for the input gradient only (zero-bubble "B")
    W = "W"  # backward for the weight gradients only (zero-bubble "W")
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    GRAD_SYNC = "GRAD_SYNC"  # BitPipe: sum one stage's gradients across the two replicas


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
COMM_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})

_ACTION_PATTERN = re.compile(r"^(?:R(\d+):)?(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|GRAD_SYNC|F|B|I|W)(\d*)$")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: `kind` on `stage` for `microbatch` (None for GRAD_SYNC) of `replica`."""

    kind: Kind
    stage: int
    microbatch: int | None = None
    replica: int = 0

    def __str__(self) -> str:
        prefix = f"R{self.replica}:" if self.replica else ""
        suffix = "" if self.microbatch is None else str(self.microbatch)
        return f"{prefix}{self.stage}{self.kind.value}{suffix}"

    __repr__ = __str__

    @staticmethod
    def parse(text: str) -> Action:
        """Inverse of `str(action)`: `"2F0"` -> Action(F, stage=2, microbatch=0)."""
        match = _ACTION_PATTERN.match(text.strip())
        if match is None:
            raise ValueError(f"bad action {text!r}: expected e.g. '2F0', '1W3', '0SEND_F1' or 'R1:2B0'")
        replica, stage, kind, microbatch = match.groups()
        return Action(Kind(kind), int(stage), int(microbatch) if microbatch else None, int(replica or 0))


class PlacementKind(str, Enum):
    LOOP = "loop"  # stage s on rank s % p (GPipe, 1F1B, Megatron interleaved)
    V = "v"  # 2 chunks per rank, down then back up: rank r holds stages r and 2p-1-r (ZB-V)
    BIDIRECTIONAL = "bidirectional"  # BitPipe: two V-shaped replicas running in opposite directions


@dataclass(frozen=True)
class Placement:
    """Which rank holds each (stage, replica); `chunks` stages per rank per replica."""

    kind: PlacementKind
    pp: int
    chunks: int = 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks

    @property
    def replicas(self) -> int:
        return 2 if self.kind is PlacementKind.BIDIRECTIONAL else 1

    def rank_of(self, stage: int, replica: int = 0) -> int:
        p = self.pp
        if self.kind is PlacementKind.LOOP:
            return stage % p
        down_up = stage if stage < p else 2 * p - 1 - stage  # the V: 0..p-1 then p-1..0
        # BitPipe's second replica enters at the last rank: the mirror image of the first (Wu et al. Fig. 3)
        return down_up if replica == 0 else p - 1 - down_up

    def stages_of(self, rank: int) -> list[tuple[int, int]]:
        """The (stage, replica) pairs that `rank` holds, in stage order."""
        return [
            (stage, replica)
            for replica in range(self.replicas)
            for stage in range(self.num_stages)
            if self.rank_of(stage, replica) == rank
        ]


def replica_of(microbatch: int, microbatches: int, replicas: int) -> int:
    """BitPipe gives each replica one half of the micro-batches; with one replica everything is 0."""
    return int(replicas == 2 and microbatch >= (microbatches + 1) // 2)


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists plus what is needed to read them.

    `replica_of[j]` is the replica that micro-batch j runs on (all 0 except for BitPipe).
    `lowered` says whether communication actions have been inserted (see lowering.py).
    """

    name: str
    placement: Placement
    microbatches: int
    ranks: tuple[tuple[Action, ...], ...]
    lowered: bool = False

    @property
    def pp(self) -> int:
        return self.placement.pp

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    def replica_of(self, microbatch: int) -> int:
        return replica_of(microbatch, self.microbatches, self.placement.replicas)

    def compute_actions(self, rank: int) -> list[Action]:
        return [action for action in self.ranks[rank] if action.kind in COMPUTE_KINDS]

    def format(self) -> str:
        """One line per rank, e.g. `rank 0: 0F0 0F1 0B0 ...`."""
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.ranks))


def split_keys(actions: Iterable[Action]) -> set[tuple[int, int, int]]:
    """(stage, micro-batch, replica) of every micro-batch whose backward is split into I + W: the
    executor runs their forwards with deferrable linears, the simulator prices them apart."""
    return {(a.stage, a.microbatch, a.replica) for a in actions if a.kind is Kind.I}


def write_csv(rank_actions: Sequence[Sequence[Action]], path: str | Path) -> None:
    """Write one CSV row per rank of action strings (torch.distributed.pipelining's `_dump_csv` layout)."""
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        for actions in rank_actions:
            writer.writerow([str(action) for action in actions])


def read_csv(path: str | Path) -> list[list[Action]]:
    """Read what `write_csv` (or PyTorch's `_dump_csv`) wrote; empty cells (PyTorch's None) are skipped."""
    with open(path, newline="") as handle:
        return [[Action.parse(cell) for cell in row if cell.strip()] for row in csv.reader(handle)]
