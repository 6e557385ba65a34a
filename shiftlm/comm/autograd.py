"""Autograd-aware conjugate pairs of the collectives in `comm/ops.py`.

They follow Megatron-LM (`mappings.py`) and nanotron: each forward's backward is its twin, and every
op is the identity on a group of one.

    copy_to_group        forward: identity,               backward: all-reduce     (Megatron `f`)
    reduce_from_group    forward: all-reduce,             backward: identity       (Megatron `g`)
    gather_along         forward: all-gather (dim),       backward: reduce-scatter (dim)
    reduce_scatter_along forward: reduce-scatter (dim),   backward: all-gather     (dim)
    split_along          forward: keep my chunk (dim),    backward: all-gather     (dim)
    all_to_all           forward: all-to-all (scatter s, gather g), backward: all-to-all (scatter g, gather s)
    all_to_all_rows      forward: uneven all-to-all of rows,  backward: the same with the counts swapped
"""

from __future__ import annotations

import torch

from shiftlm.comm.group import CommGroup
from shiftlm.comm.ops import all_gather, all_reduce, all_to_all, all_to_all_uneven, reduce_scatter


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, ctx.dim), None, None


class _SplitAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return x.chunk(group.size, dim=dim)[group.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, ctx.dim), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


class _AllToAllUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, send_rows, recv_rows):
        ctx.group, ctx.send_rows, ctx.recv_rows = group, send_rows, recv_rows
        return all_to_all_uneven(x, group, send_rows, recv_rows)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_uneven(grad.contiguous(), ctx.group, ctx.recv_rows, ctx.send_rows), None, None, None


def copy_to_group(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """forward: identity, backward: all-reduce (enter a tensor-parallel region)."""
    return x if group.size == 1 else _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """forward: all-reduce, backward: identity (leave a row-parallel layer)."""
    return x if group.size == 1 else _ReduceFromGroup.apply(x, group)


def gather_along(x: torch.Tensor, group: CommGroup, dim: int) -> torch.Tensor:
    """forward: all-gather along `dim`, backward: reduce-scatter along `dim`."""
    return x if group.size == 1 else _GatherAlong.apply(x, group, dim)


def reduce_scatter_along(x: torch.Tensor, group: CommGroup, dim: int) -> torch.Tensor:
    """forward: reduce-scatter along `dim`, backward: all-gather along `dim`."""
    return x if group.size == 1 else _ReduceScatterAlong.apply(x, group, dim)


def split_along(x: torch.Tensor, group: CommGroup, dim: int) -> torch.Tensor:
    """forward: keep this rank's chunk of `dim`, backward: all-gather along `dim`."""
    return x if group.size == 1 else _SplitAlong.apply(x, group, dim)


def all_to_all_along(x: torch.Tensor, group: CommGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """forward: all-to-all (scatter `scatter_dim`, gather `gather_dim`), backward: the inverse all-to-all."""
    return x if group.size == 1 else _AllToAll.apply(x, group, scatter_dim, gather_dim)


class _GatherNoReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.group.size, dim=ctx.dim)[ctx.group.rank].contiguous(), None, None


def gather_replicated(x: torch.Tensor, group: CommGroup, dim: int) -> torch.Tensor:
    """forward: all-gather along `dim`, backward: keep my chunk (the gradient is already whole on every rank)."""
    return x if group.size == 1 else _GatherNoReduce.apply(x, group, dim)


def all_to_all_rows(
    x: torch.Tensor, group: CommGroup, send_rows: list[int], recv_rows: list[int]
) -> torch.Tensor:
    """forward: uneven all-to-all of rows (`all_to_all_uneven`), backward: the same with the counts swapped."""
    return x if group.size == 1 else _AllToAllUneven.apply(x, group, send_rows, recv_rows)
