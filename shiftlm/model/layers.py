"""Megatron-LM parallel layers (Shoeybi et al. 2019, sec. 3; Korthikanti et al. 2022, sec. 4.2.2).

Each layer is handed its tensor-parallel group. With `sequence_parallel`, activations outside the
column->row regions are split along the sequence (dim 1) across the TP group: a column-parallel layer
all-gathers its input (backward: reduce-scatter), a row-parallel layer reduce-scatters its output
(backward: all-gather) instead of all-reducing it.

Every forward takes the caller's `ops` (model/ops.py): how its linears and norms run (autograd's,
deferrable for zero-bubble pipeline schedules, serving's inference kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shiftlm.comm import CommGroup, copy_to_group, gather_along, reduce_from_group, reduce_scatter_along
from shiftlm.model.ops import PLAIN, Ops

SEQ_DIM = 1


class RMSNorm(nn.Module):
    """RMSNorm as in Llama: computed in fp32, scaled in the input dtype (matches `transformers`)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: Ops = PLAIN) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T with A split by rows (output features) across the group: each rank gets Y's columns."""

    def __init__(
        self,
        in_features: int,
        out_features_local: int,
        group: CommGroup,
        bias: bool = False,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features_local, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features_local)) if bias else None
        self.group = group
        self.sequence_parallel = sequence_parallel

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Bring the input into the TP region (gather the sequence, or mark it for grad all-reduce)."""
        if self.sequence_parallel:
            return gather_along(x, self.group, SEQ_DIM)
        return copy_to_group(x, self.group)

    def forward(self, x: torch.Tensor, entered: bool = False, ops: Ops = PLAIN) -> torch.Tensor:
        return ops.linear(x if entered else self.enter(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = X A^T with A split by columns (input features): partial outputs are summed over the group."""

    def __init__(
        self, in_features_local: int, out_features: int, group: CommGroup, sequence_parallel: bool = False
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features_local))
        self.group = group
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor, ops: Ops = PLAIN) -> torch.Tensor:
        partial = ops.linear(x, self.weight)
        if self.sequence_parallel:
            return reduce_scatter_along(partial, self.group, SEQ_DIM)
        return reduce_from_group(partial, self.group)


class VocabParallelEmbedding(nn.Module):
    """Embedding with the (padded) vocabulary split across the group; rows this rank lacks read as zero."""

    def __init__(
        self,
        vocab_start: int,
        rows_local: int,
        hidden: int,
        group: CommGroup,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows_local, hidden))
        self.vocab_start = vocab_start
        self.group = group
        self.sequence_parallel = sequence_parallel
        # serving (ShiftModel): the whole table on every rank, so a lookup needs no all-reduce
        self.full_table: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.full_table is not None and not self.sequence_parallel:
            return F.embedding(ids, self.full_table)
        if self.group.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_along(out, self.group, SEQ_DIM)
        return reduce_from_group(out, self.group)
