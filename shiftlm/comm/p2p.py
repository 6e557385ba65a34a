"""Point-to-point helpers (pipeline hand-offs, ring attention's K/V and dK/dV blocks on the `cp`
group), counted like the collectives and noted in the ledger.

On gloo use these (`isend`/`irecv`), never `batch_isend_irecv`, which can hang there. While the
collective ledger is on they return a `TrackedWork` (same `wait()`), whose wait records the exit time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shiftlm.comm.group import CommGroup, counters
from shiftlm.comm.ledger import TrackedWork, ledger


def _start(op: str, tensor: torch.Tensor, peer: int, group: CommGroup, tag: int) -> dist.Work | TrackedWork:
    nbytes = tensor.numel() * tensor.element_size()
    counters.record(op, group, nbytes)
    record = ledger.enter(op, group, nbytes, peer=peer, tag=tag, async_op=True)
    if op == "send":
        work = dist.isend(tensor, dst=peer, group=group.pg, tag=tag)
    else:
        work = dist.irecv(tensor, src=peer, group=group.pg, tag=tag)
    return work if record is None else TrackedWork(work, record, tensor)


def isend(tensor: torch.Tensor, dst: int, group: CommGroup, tag: int = 0) -> dist.Work | TrackedWork:
    """Start sending `tensor` to global rank `dst`; wait on the returned handle before reusing it."""
    return _start("send", tensor.contiguous(), dst, group, tag)


def irecv(tensor: torch.Tensor, src: int, group: CommGroup, tag: int = 0) -> dist.Work | TrackedWork:
    """Start receiving into `tensor` from global rank `src`."""
    return _start("recv", tensor, src, group, tag)
