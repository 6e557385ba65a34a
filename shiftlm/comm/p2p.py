"""Point-to-point helpers (pipeline hand-offs, ring attention's K/V and dK/dV blocks on the `cp`
group, tied-weight gradient sums), counted like the collectives and noted in the ledger.

Matching differs by backend: gloo matches a send with a receive by tag; NCCL ignores tags and matches
the operations of two ranks in the order each posts them, and a lone NCCL send waits (on the GPU)
until the peer's receive runs. So every caller follows two rules, which make it right on both:
- for each pair of ranks, both sides post their operations in the same order (the k-th operation of
  one is the counterpart of the k-th of the other);
- a send and a receive that must progress together (two ranks sending to each other at the same
  time) are started by one `exchange` call: on NCCL one `batch_isend_irecv` group, on gloo plain
  `isend` / `irecv` (gloo's sends never wait for the receive, and its `batch_isend_irecv` can hang).
`tests/pipeline/test_p2p_posting_order.py` records what every caller posts and checks both rules.
On a group with a shared-memory channel (`comm/shm_p2p.py`, ranks of one host, CPU tensors) the
operations go through its rings instead, matched by posting order as on NCCL.
While the collective ledger is on they return a `TrackedWork` (same `wait()`), whose wait records
the exit time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from shiftlm.comm import shm_p2p
from shiftlm.comm.group import CommGroup, counters
from shiftlm.comm.ledger import TrackedWork, ledger

Op = tuple[str, torch.Tensor, int, int]  # ("send" | "recv", tensor, global peer rank, tag)


def _post(ops: Sequence[Op], group: CommGroup, shm: bool | None = None) -> list[dist.Work | TrackedWork]:
    """Start `ops` together (one NCCL group when there are several on NCCL); one handle each.
    `shm`: None uses the group's shared-memory channel for CPU tensors where one was enabled, False
    never does (gloo / NCCL), True requires it."""
    records = []
    for op, tensor, peer, tag in ops:
        nbytes = tensor.numel() * tensor.element_size()
        counters.record(op, group, nbytes)
        records.append(ledger.enter(op, group, nbytes, peer=peer, tag=tag, async_op=True))
    local = None if shm is False else shm_p2p.channel(group)
    if shm and local is None:
        raise RuntimeError(f"no shared-memory point-to-point channel was enabled for {group}")
    if local is not None and all(tensor.device.type == "cpu" for _, tensor, _, _ in ops):
        works = [
            local.isend(tensor, peer, tag) if op == "send" else local.irecv(tensor, peer, tag)
            for op, tensor, peer, tag in ops
        ]
    elif len(ops) > 1 and dist.get_backend(group.pg) == "nccl":
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend if op == "send" else dist.irecv, tensor, peer, group.pg, tag)
                for op, tensor, peer, tag in ops
            ]
        )
    else:
        works = [
            dist.isend(tensor, dst=peer, group=group.pg, tag=tag)
            if op == "send"
            else dist.irecv(tensor, src=peer, group=group.pg, tag=tag)
            for op, tensor, peer, tag in ops
        ]
    return [
        work if record is None else TrackedWork(work, record, op[1])
        for work, record, op in zip(works, records, ops)
    ]


def isend(
    tensor: torch.Tensor, dst: int, group: CommGroup, tag: int = 0, shm: bool | None = None
) -> dist.Work | TrackedWork:
    """Start sending `tensor` to global rank `dst`; wait on the returned handle before reusing it.
    `shm`: the transport (see `_post`)."""
    return _post([("send", tensor.contiguous(), dst, tag)], group, shm)[0]


def irecv(
    tensor: torch.Tensor, src: int, group: CommGroup, tag: int = 0, shm: bool | None = None
) -> dist.Work | TrackedWork:
    """Start receiving into `tensor` from global rank `src`."""
    return _post([("recv", tensor, src, tag)], group, shm)[0]


def exchange(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    group: CommGroup,
    tag: int = 0,
) -> list[dist.Work | TrackedWork]:
    """Start sends ((tensor, dst)) and receives ((buffer, src)) that must progress together, as one
    NCCL group; handles in the order given, sends first."""
    ops: list[Op] = [("send", tensor.contiguous(), dst, tag) for tensor, dst in sends]
    ops += [("recv", buffer, src, tag) for buffer, src in recvs]
    return _post(ops, group)
