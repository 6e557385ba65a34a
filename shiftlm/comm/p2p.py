"""Point-to-point helpers (pipeline hand-offs), counted like the collectives.

On gloo use these (`isend`/`irecv`), never `batch_isend_irecv`, which can hang there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shiftlm.comm.group import CommGroup, counters


def isend(tensor: torch.Tensor, dst: int, group: CommGroup) -> dist.Work:
    """Start sending `tensor` to global rank `dst`; wait on the returned handle before reusing it."""
    tensor = tensor.contiguous()
    counters.record("send", group, tensor.numel() * tensor.element_size())
    return dist.isend(tensor, dst=dst, group=group.pg)


def irecv(tensor: torch.Tensor, src: int, group: CommGroup) -> dist.Work:
    """Start receiving into `tensor` from global rank `src`."""
    counters.record("recv", group, tensor.numel() * tensor.element_size())
    return dist.irecv(tensor, src=src, group=group.pg)
