"""Collectives over a `CommGroup`: raw ops that count bytes (their autograd pairs: comm/autograd.py).

Gloo has no reduce-scatter, so there it is an all-reduce followed by taking this rank's chunk.

Every raw op counts its bytes in `comm.counters` and notes its enter and exit in the collective
ledger (`comm/ledger.py`, off by default), through `_enter`.

Traced by `torch.compile`, a raw op becomes a custom op (`torch.ops.shiftlm.*`, opaque to dynamo and
inductor) that runs the same eager code when the graph runs: so a compiled block or serving step keeps
its collectives in place, in one graph, instead of breaking at each (dynamo cannot trace a
`ProcessGroup` call). The autograd pairs call the raw ops, so they trace too: a TP or SP block
trains as one graph, and its backward's collectives are these ops again.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shiftlm.comm import shm
from shiftlm.comm.group import CommGroup, counters
from shiftlm.comm.ledger import Record, TrackedWork, ledger
from shiftlm.comm.wait import run_blocking

SHM_DTYPES = (torch.float32, torch.float64)  # what the shared-memory sum adds (others: gloo)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _enter(op: str, group: CommGroup, tensor: torch.Tensor, async_op: bool = False) -> Record | None:
    """Count the bytes (this rank's input) and open a ledger record; one place for both, so they agree."""
    nbytes = _nbytes(tensor)
    counters.record(op, group, nbytes)
    return ledger.enter(op, group, nbytes, async_op=async_op)


def _tracing() -> bool:
    """Inside `torch.compile`'s tracing: a raw op emits its custom op instead of running."""
    return torch.compiler.is_compiling()


@torch.library.custom_op("shiftlm::all_reduce", mutates_args=())
def _traced_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    return all_reduce(x, CommGroup.by_key(group))


@_traced_all_reduce.register_fake
def _(x, group):
    return torch.empty_like(x)


@torch.library.custom_op("shiftlm::all_gather", mutates_args=())
def _traced_all_gather(x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    return all_gather(x, CommGroup.by_key(group), dim)


@_traced_all_gather.register_fake
def _(x, group, dim):
    shape = list(x.shape)
    shape[dim] *= CommGroup.by_key(group).size
    return x.new_empty(shape)


@torch.library.custom_op("shiftlm::reduce_scatter", mutates_args=())
def _traced_reduce_scatter(x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    return reduce_scatter(x, CommGroup.by_key(group), dim)


@_traced_reduce_scatter.register_fake
def _(x, group, dim):
    shape = list(x.shape)
    shape[dim] //= CommGroup.by_key(group).size
    return x.new_empty(shape)


@torch.library.custom_op("shiftlm::all_to_all", mutates_args=())
def _traced_all_to_all(x: torch.Tensor, group: str, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    return all_to_all(x, CommGroup.by_key(group), scatter_dim, gather_dim)


@_traced_all_to_all.register_fake
def _(x, group, scatter_dim, gather_dim):
    size, shape = CommGroup.by_key(group).size, list(x.shape)
    shape[scatter_dim] //= size
    shape[gather_dim] *= size
    return x.new_empty(shape)


# Every rank must run every collective, including one whose result this rank ends up not using (a
# rank with no sampled row in an SP x TP step): never dead code to inductor, as PyTorch marks its
# functional collectives' waits. Without this, a rank whose graph dropped the last layer's sums
# paired its next collective with another rank's sum (wrong logits, then a hang).
for _op in (_traced_all_reduce, _traced_all_gather, _traced_reduce_scatter, _traced_all_to_all):
    torch.fx.node.has_side_effect(_op._opoverload)


def all_reduce(
    tensor: torch.Tensor,
    group: CommGroup,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    *,
    async_op: bool = False,
    in_place: bool = False,
) -> torch.Tensor | TrackedWork:
    """All-reduce; out of place unless `in_place` (then `tensor` must be contiguous).

    With `async_op` it returns a `TrackedWork` whose `wait()` returns the reduced tensor and records
    the exit time (bucketed gradient sync overlaps these with backward).
    """
    if in_place and not tensor.is_contiguous():
        raise ValueError("all_reduce(in_place=True) needs a contiguous tensor")
    if _tracing() and group.size > 1:
        if async_op or in_place or op is not dist.ReduceOp.SUM:
            raise NotImplementedError("a traced all_reduce is a synchronous, out-of-place sum")
        return _traced_all_reduce(tensor, group.key)
    out = tensor if in_place or group.size == 1 else tensor.contiguous().clone()
    if group.size == 1:
        return TrackedWork(None, None, out) if async_op else out
    record = _enter("all_reduce", group, out, async_op)
    local = shm.channel(group)
    if local is not None and not async_op and op == dist.ReduceOp.SUM and out.dtype in SHM_DTYPES:
        local.all_reduce_(out)  # ranks of one host: through shared memory (comm/shm.py)
        ledger.exit(record)
        return out
    if async_op:
        return TrackedWork(dist.all_reduce(out, op=op, group=group.pg, async_op=True), record, out)
    run_blocking(dist.all_reduce, out, op=op, group=group.pg)
    ledger.exit(record)
    return out


def all_gather(tensor: torch.Tensor, group: CommGroup, dim: int) -> torch.Tensor:
    """Concatenate every rank's tensor along `dim`, in group-rank order."""
    if group.size == 1:
        return tensor
    if _tracing():
        return _traced_all_gather(tensor, group.key, dim)
    tensor = tensor.contiguous()
    record = _enter("all_gather", group, tensor)
    local = shm.channel(group)
    if local is not None:
        parts = local.all_gather(tensor)
    else:
        parts = [torch.empty_like(tensor) for _ in range(group.size)]
        dist.all_gather(parts, tensor, group=group.pg)
    ledger.exit(record)
    return torch.cat(parts, dim=dim)


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """parts[0] + ... + parts[n-1] in one fixed binary tree: (0+1), (2+3), ..., then pairs of those
    (an odd one out is carried up a level). The order a recursive-doubling all-reduce adds in, so a
    sum split into aligned power-of-two blocks (summed where they lie, then across) is bit for bit
    this one (`deterministic` training, docs/moe.md)."""
    while len(parts) > 1:
        pairs = [parts[i] + parts[i + 1] for i in range(0, len(parts) - 1, 2)]
        parts = pairs + parts[len(parts) - len(parts) % 2 :]
    return parts[0]


def tree_all_reduce(tensor: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Sum over the group in `tree_sum`'s order of group ranks, the same bits on every rank and for
    every buffer the elements sit in (a ring or shared-memory all-reduce adds in an order that depends
    on the group and on where an element lies). An all-gather and a local sum: group.size x the
    memory and traffic of one buffer, the price of `train.deterministic`. Out of place."""
    if group.size == 1:
        return tensor.clone()
    return tree_sum(list(all_gather(tensor.contiguous().unsqueeze(0), group, 0).unbind(0)))


def all_gather_flat(
    output: torch.Tensor, shard: torch.Tensor, group: CommGroup, *, async_op: bool = False
) -> torch.Tensor | TrackedWork:
    """`output` (flat, group.size x shard.numel()) becomes every rank's `shard` in group-rank order.

    The `all_gather_into_tensor` pattern of ZeRO parameter gathers. On gloo it gathers into views of
    `output` instead: gloo's flat all-gather only exists in recent torch, the views work on all.
    `shard` must not be a view of `output` (the collective may not read its own destination).
    """
    shard = shard.contiguous()
    if output.numel() != shard.numel() * group.size or not output.is_contiguous():
        raise ValueError(
            f"all_gather_flat: output must be contiguous with {group.size} x {shard.numel()} elements, "
            f"got {tuple(output.shape)}"
        )
    if group.size == 1:
        output.view(-1).copy_(shard.view(-1))
        return TrackedWork(None, None, output) if async_op else output
    record = _enter("all_gather", group, shard, async_op)
    if dist.get_backend(group.pg) == "gloo":
        views = list(output.view(-1).chunk(group.size))
        work = dist.all_gather(views, shard.view(-1), group=group.pg, async_op=async_op)
    else:
        work = dist.all_gather_into_tensor(output, shard, group=group.pg, async_op=async_op)
    if async_op:
        return TrackedWork(work, record, output)
    ledger.exit(record)
    return output


def reduce_scatter(tensor: torch.Tensor, group: CommGroup, dim: int) -> torch.Tensor:
    """Sum over ranks, then keep this rank's chunk of `dim`."""
    if group.size == 1:
        return tensor
    if tensor.shape[dim] % group.size:
        raise ValueError(
            f"reduce_scatter: dim {dim} of {tuple(tensor.shape)} does not split into {group.size}"
        )
    if _tracing():
        return _traced_reduce_scatter(tensor, group.key, dim)
    tensor = tensor.contiguous()
    record = _enter("reduce_scatter", group, tensor)
    if dist.get_backend(group.pg) == "gloo":
        summed = tensor.clone()
        dist.all_reduce(summed, group=group.pg)
        ledger.exit(record)
        return summed.chunk(group.size, dim=dim)[group.rank].contiguous()
    parts = [p.contiguous() for p in tensor.chunk(group.size, dim=dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group.pg)
    ledger.exit(record)
    return out


def all_to_all(tensor: torch.Tensor, group: CommGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `scatter_dim` into group-size chunks, send chunk i to rank i, concatenate what arrives on `gather_dim`."""
    if group.size == 1:
        return tensor
    if _tracing():
        return _traced_all_to_all(tensor, group.key, scatter_dim, gather_dim)
    record = _enter("all_to_all", group, tensor)
    local = shm.channel(group)
    if local is not None:
        outputs = local.all_to_all([c.contiguous() for c in tensor.chunk(group.size, dim=scatter_dim)])
    else:
        # one buffer, equal splits on dim 0: all_to_all_single, which gloo has on every torch we
        # support (its list all_to_all only from 2.12) and NCCL runs as one grouped call
        send = torch.stack(tensor.chunk(group.size, dim=scatter_dim))
        received = torch.empty_like(send)
        run_blocking(dist.all_to_all_single, received, send, group=group.pg)
        outputs = received.unbind(0)
    ledger.exit(record)
    return torch.cat(outputs, dim=gather_dim)


def all_to_all_uneven(
    tensor: torch.Tensor, group: CommGroup, send_rows: list[int], recv_rows: list[int]
) -> torch.Tensor:
    """Rows [sum(send_rows[:i]), +send_rows[i]) of `tensor` go to group rank i; what arrives is
    concatenated in source order (`recv_rows[i]` rows from rank i): MoE token dispatch and combine."""
    if group.size == 1:
        return tensor
    record = _enter("all_to_all", group, tensor)
    out = tensor.new_empty((sum(recv_rows), *tensor.shape[1:]))
    # all_to_all_single: gloo's list all_to_all needs equal sizes, its alltoall_base takes splits
    run_blocking(dist.all_to_all_single, out, tensor.contiguous(), recv_rows, send_rows, group=group.pg)
    ledger.exit(record)
    return out


def broadcast(tensor: torch.Tensor, group: CommGroup, src_group_rank: int = 0) -> torch.Tensor:
    if group.size == 1:
        return tensor
    record = _enter("broadcast", group, tensor)
    dist.broadcast(tensor, src=group.ranks[src_group_rank], group=group.pg)
    ledger.exit(record)
    return tensor
