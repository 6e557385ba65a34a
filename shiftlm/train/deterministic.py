"""`train.deterministic`: a step whose bits do not depend on ep (Megatron's `--deterministic-mode`,
torchtitan's `debug.deterministic`; docs/moe.md, "Bit-exact across ep").

At a fixed data-parallel size D the token ranks f = 0..D-1 compute the same per-token numbers at every
ep: what moves between ep values is where sums are taken. With the flag each such sum is one fixed
binary tree over f (`comm.tree_sum`):
- an expert's weight gradient: one GEMM per (source rank, expert) block of rows, the sources of the
  holder's ep group (an aligned block of EP token ranks) summed by a tree on the holder
  (`model.moe_deterministic.blockwise_swiglu`), then across `edp` by `comm.tree_all_reduce`, which continues the
  same tree when D and ep are powers of two;
- every other gradient: `tree_all_reduce` over dp_sp, whose result does not depend on where an element
  lies in its bucket (the flat buffers are laid out differently at each ep);
- the clipping norm: one square sum per tensor, each put by its one owner at the tensor's place in a
  vector ordered by name, so the vector and its sum are the same at every layout (`CanonicalNorm`).
The AdamW update is element-wise; the loss reported is summed by `tree_all_reduce` too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shiftlm.comm import all_reduce
from shiftlm.errors import ConfigError
from shiftlm.mesh import Mesh
from shiftlm.model.sharding import is_expert_param
from shiftlm.parallel import ParallelConfig
from shiftlm.train.flat import FlatParameters


def check_deterministic(parallel: ParallelConfig, zero: int) -> None:
    """The layouts the flag covers, refused in one line otherwise (their sums would ignore it)."""
    if zero >= 2:
        raise ConfigError(
            f"train.deterministic with train.zero = {zero}: sharded gradients are reduce-scattered in "
            "the group's order; use train.zero = 0 or 1"
        )
    if parallel.expert_tp != parallel.tp:
        raise ConfigError(
            f"train.deterministic with parallel.etp = {parallel.etp} != tp = {parallel.tp}: the etp "
            "gather mixes the rows of several tp ranks; leave etp unset (expert TP = TP)"
        )


class CanonicalNorm:
    """The global gradient norm summed in one order at every layout (ZeRO-0/1: full gradients).

    Each tensor's square sum (fp64) goes to its place in a vector indexed by the sorted keys
    (pp rank, tp rank, name) of the whole model, on one owner only: the rank that `counted` names
    (replica 0, first TP holder) and that is rank 0 of the tensor's data group (`edp` for routed
    experts, `dp_sp` else; the others hold the same sums). Every other rank adds zeros, so the
    all-reduce of the vector is exact in any order, and its sum is taken locally in index order."""

    def __init__(self, flat: FlatParameters, counted: set[str], mesh: Mesh):
        self.flat, self.mesh = flat, mesh
        prefix = f"{mesh.coords.pp}/{mesh.tp.rank}/"
        names = [prefix + slot.name for slot in flat.slots]
        everyone = [names]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, names)
        index = {key: i for i, key in enumerate(sorted({key for keys in everyone for key in keys}))}
        self.size = len(index)

        def owner(name: str) -> bool:
            group = mesh.edp if is_expert_param(name) else mesh.dp_sp
            return name in counted and group.rank == 0

        self.entries = [(slot, index[prefix + slot.name]) for slot in flat.slots if owner(slot.name)]

    @torch.no_grad()
    def __call__(self) -> float:
        squares = torch.zeros(self.size, dtype=torch.float64, device=self.flat.device)
        for slot, position in self.entries:
            grad = self.flat.grads[slot.offset : slot.offset + slot.numel].double()
            squares[position] = torch.dot(grad, grad)
        for group in (self.mesh.dp_sp, self.mesh.tp, self.mesh.pp):
            squares = all_reduce(squares, group)
        return float(squares.sum().sqrt())
