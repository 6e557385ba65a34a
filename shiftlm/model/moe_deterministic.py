"""`train.deterministic`'s expert GEMMs (docs/moe.md, "Bit-exact across ep"): one GEMM per (source
rank, expert) block of rows, each source's weight gradient kept apart and summed by one fixed tree,
so the step's bits do not depend on ep. Used by `moe.SparseMoE.local_experts_forward`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shiftlm.comm import tree_sum


class SourceGrads:
    """The deterministic expert GEMMs' weight gradients kept per (weight, source rank): each source's
    summed over the step's micro-batches in their order, as its own rank would at ep 1, and `flush`
    then adds the sources' sums into `.grad` by `comm.tree_sum` (in autograd's order of arrival, or
    summed over sources per micro-batch, the order would depend on ep). Sources x the local experts'
    weights of memory while a step runs."""

    def __init__(self):
        self._sums: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    @torch.no_grad()
    def add(self, weight: torch.Tensor, grads: tuple[torch.Tensor, ...]) -> None:
        entry = self._sums.get(id(weight))
        if entry is None:
            self._sums[id(weight)] = (weight, [grad.clone() for grad in grads])
            return
        for total, grad in zip(entry[1], grads):
            total += grad

    @torch.no_grad()
    def flush(self) -> None:
        """Each weight's sources summed by the tree into its `.grad` (at the step's end, before the
        data-parallel sum)."""
        for weight, sums in self._sums.values():
            total = tree_sum(sums)
            if weight.grad is None:
                weight.grad = total
            else:
                weight.grad += total
        self._sums.clear()


class _FanOut(torch.autograd.Function):
    """forward: `copies` aliases of a weight, one per block of rows that uses it; backward: their
    gradients (one GEMM's each) go to `sums` (`SourceGrads`), not to the weight by autograd."""

    @staticmethod
    def forward(ctx, weight, copies, sums):
        ctx.weight, ctx.sums = weight, sums
        return tuple(weight.view_as(weight) for _ in range(copies))

    @staticmethod
    def backward(ctx, *grads):
        ctx.sums.add(ctx.weight, grads)
        return None, None, None


def blockwise_swiglu(
    x: torch.Tensor,
    counts: torch.Tensor,
    weights: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    sums: SourceGrads,
) -> torch.Tensor:
    """The deterministic expert GEMMs (`SparseMoE.deterministic`): rows ordered by (source rank, expert),
    `counts[s, e]` of them, each block through its expert by GEMMs of its own, so a source's rows and
    its partial weight gradient are computed as if that rank held the expert alone (ep 1); the weight
    gradients go to `sums` per source (`SourceGrads`). `weights[e]`: (gate, up, down) of local expert
    e. Output in the rows' order."""
    sources, local = counts.shape
    copies = [[_FanOut.apply(w, sources, sums) for w in expert] for expert in weights]
    parts = []
    for block_index, block in enumerate(x.split(counts.flatten().tolist(), dim=0)):
        source, expert = divmod(block_index, local)
        gate, up, down = (copy[source] for copy in copies[expert])
        parts.append(F.linear(F.silu(F.linear(block, gate)) * F.linear(block, up), down))
    return torch.cat(parts, dim=0) if parts else x.new_zeros(0, x.shape[-1])
