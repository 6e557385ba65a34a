"""Collectives among the ranks of one host through shared memory, for serving's CPU ranks.

A gloo collective on a virtual machine is a chain of sleeps and wake-ups (the caller, gloo's worker
thread, its socket thread, the peer's): an all-reduce that takes 0.2 ms back to back took 1.5-2 ms
inside a serving step, and a 2-rank decode step was 22 ms of wall time for 4 ms of CPU
(docs/serving.md, "Shared-memory collectives"). vLLM's CPU backend sums its tensor-parallel
partials through shared memory instead; this is the same idea: a `ShmChannel` maps one segment in
/dev/shm on every rank of a group (all on one host), each rank writes its data into its own slot,
publishes a generation number and waits, spinning briefly, then yielding the core, then sleeping on
a futex the publisher wakes, for every rank's (kernels/csrc/shm_exchange.cpp). The sum runs in rank order on every rank, so all
ranks get the same bits (and, for 2 ranks, gloo's).

`enable(group, kernels)` (collective over the group) makes a channel where every rank of the group is
on this host and the CPU kernels build; `comm.ops.all_reduce` (fp32/fp64 sums), `all_gather` and
`all_to_all` then go through it, and so do the serving runner's plan broadcast and logits gather. A rank that exits is
noticed by its peers (its pid is in the segment) and their collective raises; a rank that stops
without exiting is the rank monitor's to find, as with gloo.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from shiftlm.comm.group import CommGroup

log = logging.getLogger(__name__)

CAPACITY = 4 << 20  # bytes of one rank's slot; larger tensors go in chunks
SHM_DIR = Path("/dev/shm")
HEADER = 64


@dataclass(frozen=True)
class WaitPolicy:
    """How a rank waits for the others: spin (`spin_s`), then yield its core until `yield_s`, then sleep
    on a futex in the segment until a peer publishes (checking every 10 ms that the peers live);
    `timeout_s` > 0 raises after that long (0: wait for ever)."""

    spin_s: float = 20e-6
    yield_s: float = 2e-3
    timeout_s: float = 0.0


_channels: dict[tuple[int, ...], ShmChannel] = {}  # by the group's ranks


class ShmChannel:
    """One shared-memory segment of a group's ranks; every rank calls its collectives in the same order."""

    def __init__(self, group: CommGroup, path: Path, module, policy: WaitPolicy, capacity: int, create: bool):
        self.group, self.module, self.policy, self.capacity = group, module, policy, capacity
        data = ((group.size * HEADER + 4095) // 4096) * 4096
        size = data + 2 * group.size * capacity
        if create:
            with open(path, "xb") as f:  # a new file of zeros (generation 0 everywhere)
                f.truncate(size)
        self.segment = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8, device="cpu")
        self.gen = 0
        module.shm_init(self.segment, group.rank, group.size, capacity)

    def _args(self) -> tuple:
        p = self.policy
        return (self.capacity, p.spin_s, p.yield_s, p.timeout_s)

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` (contiguous, fp32/fp64, CPU) over the group in place."""
        g = self.group
        self.gen = self.module.shm_all_reduce(self.segment, g.rank, g.size, self.gen, tensor, *self._args())
        return tensor

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """`tensor` (contiguous, the same size on every rank) becomes group rank `src`'s, in place."""
        g, empty = self.group, tensor.new_empty(0)
        mine, out = (tensor, empty) if g.rank == src else (empty, tensor)
        self.gen = self.module.shm_gather(
            self.segment, g.rank, g.size, self.gen, mine, out, src, *self._args()
        )
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape on all), in group-rank order, on every rank."""
        return self._gather(tensor, receive=True)

    def all_to_all(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """`inputs[j]` goes to group rank j (same shapes on every rank); returns what rank j sent here."""
        parts = self.all_gather(torch.stack(inputs))
        return [part[self.group.rank] for part in parts]

    def gather(self, tensor: torch.Tensor, dst: int) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (same shape on all), in group-rank order, on group rank `dst`; None elsewhere."""
        return self._gather(tensor, receive=self.group.rank == dst)

    def _gather(self, tensor: torch.Tensor, receive: bool) -> list[torch.Tensor] | None:
        g = self.group
        tensor = tensor.contiguous()
        out = tensor.new_empty((g.size, *tensor.shape)) if receive else tensor.new_empty(0)
        self.gen = self.module.shm_gather(
            self.segment, g.rank, g.size, self.gen, tensor, out, -1, *self._args()
        )
        return list(out.unbind(0)) if receive else None


def channel(group: CommGroup) -> ShmChannel | None:
    """The channel `enable` made for this group's ranks, or None."""
    return _channels.get(group.ranks) if group.size > 1 else None


def enable(
    group: CommGroup,
    kernels,
    policy: WaitPolicy | None = None,
    capacity: int = CAPACITY,
) -> ShmChannel | None:
    """Make (collectively, over `group.pg`) a shared-memory channel for the group, or None where one cannot
    be made: a group of one, ranks on several hosts, no /dev/shm, no C++ side. `kernels`: the built
    extension with the collectives (`model.cpu_kernels.load()`, passed in: comm sits below model), or
    None. Every rank gets the same answer. One channel per set of ranks: groups of the same ranks
    (serving's shift and tp groups at tp = 2) share it, which is safe because a rank runs its
    collectives one at a time, in the same order as its peers."""
    if group.size == 1 or group.pg is None:
        return None
    if group.ranks in _channels:
        return _channels[group.ranks]
    module = kernels if kernels is not None and hasattr(kernels, "shm_all_reduce") else None
    made = open_collectively(
        group,
        module is not None,
        lambda path, create: ShmChannel(group, path, module, policy or WaitPolicy(), capacity, create=create),
        "shared-memory collectives",
    )
    if made is not None:
        _channels[group.ranks] = made
    return made


def open_collectively(group: CommGroup, usable: bool, opener, what: str):
    """Collectively over `group.pg`: a segment in /dev/shm that every rank maps, made by
    `opener(path, create)` (rank 0 creates the file, then the others map it), or None on every rank
    where one cannot be made (ranks on several hosts, `usable` false anywhere, no /dev/shm, an error
    while creating or mapping it: logged once, `what` names the feature). The file is unlinked once
    every rank has mapped it, so nothing stays in /dev/shm."""
    here = (_host_id(), usable and os.access(SHM_DIR, os.W_OK))
    everyone: list = [None] * group.size
    dist.all_gather_object(everyone, here, group=group.pg)
    usable = all(entry == everyone[0] for entry in everyone) and everyone[0][1]
    name = [f"shiftlm-{uuid.uuid4().hex}" if usable else ""]
    dist.broadcast_object_list(name, src=group.ranks[0], group=group.pg)
    if not name[0]:
        return None
    path = SHM_DIR / name[0]
    made = None
    for creator in (True, False):  # rank 0 makes the file, then the others map it; all agree on errors
        error = ""
        if (group.rank == 0) == creator:
            try:
                made = opener(path, creator)
            except (OSError, RuntimeError) as err:  # e.g. /dev/shm full: every rank falls back together
                error = f"{type(err).__name__}: {err}"
        errors: list = [None] * group.size
        dist.all_gather_object(errors, error, group=group.pg)
        failed = [e for e in errors if e]
        if failed or not creator:
            break
    if group.rank == 0:
        path.unlink(missing_ok=True)  # every rank has mapped it (or gave up): nothing stays in /dev/shm
    if failed:
        log.warning("%s for %s not available (%s); using gloo", what, group, failed[0])
        return None
    return made


def disable_all() -> None:
    """Forget every channel (tests; a process that rebuilds its groups)."""
    _channels.clear()


def _host_id() -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
