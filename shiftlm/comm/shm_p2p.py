"""Point-to-point messages among the ranks of one host through shared memory: the pipeline's hand-offs
and BitPipe's replica gradient sums on CPU ranks.

Over gloo every message is a write on a TCP socket that gloo's socket thread of the receiving process
must be scheduled to read; on a 2-core machine running two single-thread ranks, that thread competes
with the ranks for the cores. `docs/pipeline.md` measured it: the socket threads burn 17 ms of CPU per
1F1B step and 42 ms per BitPipe step (both ranks), and a message sent before a long compute sometimes
lands 3-6 ms late. NCCL moves a message between two GPUs of one node through shared memory or NVLink,
not sockets; this module does the same for CPU ranks, as `comm/shm.py` does for serving's collectives.

A `P2PChannel` maps one segment in /dev/shm on every rank of a group: a 64-byte doorbell per rank,
then a single-producer, single-consumer byte ring per ordered pair of ranks
(`kernels/csrc/shm_exchange.cpp`: `ring_put` / `ring_get` move what fits now and ring the other side's
doorbell; `doorbell_wait` spins, yields, then sleeps on the doorbell's futex). A message is a 16-byte
header (tag, byte count) and its bytes. Matching is by posting order, as NCCL's: the k-th receive a
rank posts for a peer takes the k-th message that peer sent it, and a header that does not match
(tag or size) raises, naming both (every caller already posts each pair's operations in one order,
`comm/p2p.py`). Sends never block: what does not fit in the ring waits in the sender's queue and is
written whenever the sender waits for anything (or calls `poll()`), so two ranks sending each other
large messages cannot deadlock. A rank that exits is named by its waiting peers (its pid is in the
segment); one that hangs raises after the process group's timeout (what a gloo receive would wait;
`SHIFTLM_SHM_P2P_TIMEOUT` overrides it).

`enable(group, kernels)` (collective over the group) makes the channel where every rank is on this
host and the C++ side builds; `comm.p2p.isend` / `irecv` / `exchange` of CPU tensors on that group
then go through it. `SHIFTLM_SHM_P2P=0` keeps gloo.
"""

from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path

import torch

from shiftlm.comm.group import CommGroup
from shiftlm.comm.shm import WaitPolicy, open_collectively

RING_BUDGET = 64 << 20  # bytes of rings per group, split over its ordered pairs
MAX_RING = 8 << 20
MIN_RING = 1 << 20
DOORBELLS = 4096  # bytes: 64 per rank, page-aligned rings after them
RING_HEADER = 128
_HEADER_BYTES = 16  # int64 tag, int64 byte count

_channels: dict[tuple[str, tuple[int, ...]], P2PChannel] = {}


def ring_capacity(world: int) -> int:
    """Bytes of one ring: the budget over the group's ordered pairs, 1-8 MiB, a multiple of 4 KiB."""
    share = RING_BUDGET // max(1, world * (world - 1))
    return max(MIN_RING, min(MAX_RING, share)) // 4096 * 4096


class _Op:
    __slots__ = ("bytes", "complete", "done", "header", "nbytes", "peer", "tag")

    def __init__(self, tensor: torch.Tensor, peer: int, tag: int):
        self.bytes = (
            tensor.reshape(-1).view(torch.uint8) if tensor.numel() else tensor.new_empty(0, dtype=torch.uint8)
        )
        self.nbytes, self.peer, self.tag = self.bytes.numel(), peer, tag
        # a send's header; a receive's expected one, overwritten by what the sender sent
        self.header = torch.tensor([tag, self.nbytes], dtype=torch.int64, device="cpu")
        self.done = -_HEADER_BYTES  # bytes moved, counting from the payload's start (the header first)
        self.complete = False


class P2PWork:
    """A posted send or receive: `wait()` makes progress until it is complete (as `dist.Work`)."""

    def __init__(self, channel: P2PChannel, op: _Op):
        self.channel, self.op = channel, op

    def wait(self, timeout=None) -> bool:
        self.channel.wait_for(self.op)
        return True

    def is_completed(self) -> bool:
        if not self.op.complete:
            self.channel.poll()
        return self.op.complete


class P2PChannel:
    """The shared-memory rings of one group's ranks (see the module's docstring)."""

    def __init__(self, group: CommGroup, path: Path, module, policy: WaitPolicy, capacity: int, create: bool):
        self.group, self.module, self.policy, self.capacity = group, module, policy, capacity
        world = group.size
        self.me = group.rank
        stride = RING_HEADER + capacity
        pairs = [(i, j) for i in range(world) for j in range(world) if i != j]
        self.ring = {pair: DOORBELLS + k * stride for k, pair in enumerate(pairs)}  # byte offsets
        size = DOORBELLS + len(pairs) * stride
        if create:
            with open(path, "xb") as f:
                os.posix_fallocate(
                    f.fileno(), 0, size
                )  # all of it now: a full /dev/shm fails here, not later
        self.segment = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8, device="cpu")
        module.p2p_init(self.segment, self.me)
        self.peers = [j for j in range(world) if j != self.me]
        self.sends: dict[int, deque[_Op]] = {j: deque() for j in self.peers}
        self.recvs: dict[int, deque[_Op]] = {j: deque() for j in self.peers}
        self._busy = 0  # posted operations not complete

    def _group_rank(self, peer: int) -> int:
        return self.group.ranks.index(peer)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> P2PWork:
        """Start sending contiguous CPU `tensor` to global rank `dst`; keep it unchanged until waited."""
        op = _Op(tensor, self._group_rank(dst), tag)
        self.sends[op.peer].append(op)
        self._busy += 1
        self._push(op.peer)
        return P2PWork(self, op)

    def irecv(self, buffer: torch.Tensor, src: int, tag: int = 0) -> P2PWork:
        """Start receiving into contiguous CPU `buffer` from global rank `src`."""
        op = _Op(buffer, self._group_rank(src), tag)
        self.recvs[op.peer].append(op)
        self._busy += 1
        self._pull(op.peer)
        return P2PWork(self, op)

    def _push(self, peer: int) -> bool:
        """Write what fits of the queued sends to `peer`; True if any byte moved."""
        return self._move(self.sends[peer], self.ring[(self.me, peer)], self.module.ring_put, peer, False)

    def _pull(self, peer: int) -> bool:
        """Read what has arrived from `peer` into the receives posted for it, in order; True if any
        byte moved."""
        return self._move(self.recvs[peer], self.ring[(peer, self.me)], self.module.ring_get, peer, True)

    def _move(self, queue: deque[_Op], ring: int, move, peer: int, receiving: bool) -> bool:
        """Move the operations of `queue` through `ring` in order (each its header, then its bytes)
        with `move` (ring_put or ring_get), until one cannot finish now; True if any byte moved."""
        seg, cap, moved = self.segment, self.capacity, False
        while queue:
            op = queue[0]
            if op.done < 0:
                n = move(seg, ring, cap, op.header, _HEADER_BYTES + op.done, -op.done, peer)
                op.done += n
                moved |= n > 0
                if op.done < 0:
                    return moved
                if receiving:
                    self._check_header(op, peer)
            if op.done < op.nbytes:
                n = move(seg, ring, cap, op.bytes, op.done, op.nbytes - op.done, peer)
                op.done += n
                moved |= n > 0
                if op.done < op.nbytes:
                    return moved
            queue.popleft()
            op.complete = True
            self._busy -= 1
        return moved

    def _check_header(self, op: _Op, peer: int) -> None:
        tag, nbytes = op.header.tolist()
        if tag != op.tag or nbytes != op.nbytes:
            raise RuntimeError(
                f"shm p2p on {self.group}: rank {self.group.ranks[peer]} sent a message with tag {tag} "
                f"({nbytes} bytes) where this rank's next receive expects tag {op.tag} ({op.nbytes} "
                "bytes): the two ranks posted their operations in different orders"
            )

    def poll(self) -> bool:
        """Move what can move now (queued sends out, arrived messages in); True if anything did."""
        moved = False
        for peer in self.peers:
            if self.sends[peer]:
                moved |= self._push(peer)
            if self.recvs[peer]:
                moved |= self._pull(peer)
        return moved

    def wait_for(self, op: _Op) -> None:
        """Make progress on every posted operation until `op` is complete, sleeping on this rank's
        doorbell (rung by a peer that wrote to us or read what we wrote) when nothing can move."""
        if op.complete:
            return
        p, started = self.policy, time.perf_counter()
        read, sleep = self.module.doorbell_read, self.module.doorbell_wait
        while True:
            seen = read(self.segment, self.me)
            self.poll()
            if op.complete:
                return
            waited = time.perf_counter() - started
            sleep(self.segment, self.me, seen, self.peers, waited, p.spin_s, p.yield_s, p.timeout_s)

    @property
    def pending(self) -> int:
        """Posted operations not yet complete."""
        return self._busy


def channel(group: CommGroup) -> P2PChannel | None:
    """The channel `enable` made for this group, or None."""
    return _channels.get((group.name, group.ranks)) if group.size > 1 else None


def enable(group: CommGroup, kernels, policy: WaitPolicy | None = None) -> P2PChannel | None:
    """Make (collectively over `group.pg`) the group's shared-memory p2p channel, or None where one
    cannot be made (a group of one, ranks on several hosts, no /dev/shm or no room in it, no C++ side,
    `SHIFTLM_SHM_P2P=0`); every rank gets the same answer. `kernels`: `model.cpu_kernels.load()`
    (passed in: comm sits below model). One channel per group (name and ranks), made once."""
    if group.size == 1 or group.pg is None:
        return None
    key = (group.name, group.ranks)
    if key in _channels:
        return _channels[key]
    module = kernels if kernels is not None and hasattr(kernels, "ring_put") else None
    usable = module is not None and os.environ.get("SHIFTLM_SHM_P2P", "1") != "0"
    policy = policy or WaitPolicy(timeout_s=_timeout_s(group))
    capacity = ring_capacity(group.size)
    made = open_collectively(
        group,
        usable,
        lambda path, create: P2PChannel(group, path, module, policy, capacity, create),
        "shared-memory point-to-point",
    )
    if made is not None:
        _channels[key] = made
    return made


def _timeout_s(group: CommGroup) -> float:
    """How long a receive waits for a live peer: `SHIFTLM_SHM_P2P_TIMEOUT` (seconds), else the process
    group's own timeout (what a gloo receive would wait), else 600 s."""
    if "SHIFTLM_SHM_P2P_TIMEOUT" in os.environ:
        return float(os.environ["SHIFTLM_SHM_P2P_TIMEOUT"])
    try:  # a private accessor of torch's: only the default depends on it
        return group.pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except Exception:
        return 600.0


def disable_all() -> None:
    """Forget every channel (tests; a process that rebuilds its groups)."""
    _channels.clear()
