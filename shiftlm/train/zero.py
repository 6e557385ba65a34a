"""AdamW with ZeRO-1 optimizer-state sharding (Rajbhandari et al. 2020, ZeRO §5.1, P_os).

After the gradient all-reduce every rank of the data group holds the same summed gradients. Each
rank keeps Adam moments for only its 1/N contiguous range of the flat parameters, updates that
range, and an all-gather refills the full parameters everywhere. With `shard=False` (ZeRO-0) every
rank keeps all moments and updates everything itself; the arithmetic per element is the same, so
both give identical parameters.
"""

from __future__ import annotations

import torch

from shiftlm.comm import CommGroup, all_gather_flat, all_reduce
from shiftlm.train.config import OptimSection
from shiftlm.train.flat import FlatParameters
from shiftlm.train.optim import adamw_update


class ShardedAdamW:
    def __init__(
        self,
        flat: FlatParameters,
        group: CommGroup,
        optim: OptimSection,
        decay_mask: torch.Tensor,
        shard: bool,
    ):
        self.flat, self.group, self.optim = flat, group, optim
        self.sharded = shard and group.size > 1
        size = flat.params.numel() // group.size if self.sharded else flat.params.numel()
        self.start = group.rank * size if self.sharded else 0
        self.end = self.start + size
        self.decay_mask = decay_mask[self.start : self.end]
        self.exp_avg = torch.zeros(size)
        self.exp_avg_sq = torch.zeros(size)
        self.step_count = 0

    @torch.no_grad()
    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """Update the parameters with their (already synced) gradients times `grad_scale` (clipping)."""
        self.step_count += 1
        grad = self.flat.grads[self.start : self.end]
        if grad_scale != 1.0:
            grad = grad * grad_scale
        params = self.flat.params[self.start : self.end]
        adamw_update(
            params, grad, self.exp_avg, self.exp_avg_sq, self.decay_mask, self.step_count, lr, self.optim
        )
        if self.sharded:
            shard = params.clone()  # all_gather may not read from a view of its own output
            all_gather_flat(self.flat.params, shard, self.group)

    def _gather(self, moment: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return moment.clone()
        full = torch.empty_like(self.flat.params)
        all_gather_flat(full, moment.contiguous(), self.group)
        return full

    def full_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Layout-free moments: per parameter name, full local-shape tensors (collective over the group)."""
        return {
            "exp_avg": self.flat.unflatten(self._gather(self.exp_avg)),
            "exp_avg_sq": self.flat.unflatten(self._gather(self.exp_avg_sq)),
        }

    def load_full_state(self, state: dict[str, dict[str, torch.Tensor]], step_count: int) -> None:
        """Inverse of `full_state`: keep this rank's range of each moment."""
        self.exp_avg.copy_(self.flat.flatten(state["exp_avg"])[self.start : self.end])
        self.exp_avg_sq.copy_(self.flat.flatten(state["exp_avg_sq"])[self.start : self.end])
        self.step_count = step_count


@torch.no_grad()
def global_grad_norm(flat: FlatParameters, norm_mask: torch.Tensor, groups: list[CommGroup]) -> float:
    """The L2 norm of the whole model's gradient (all stages, all TP shards), counted once per element.

    `norm_mask` is 1 on the elements this rank counts: parameters replicated over TP (norm weights)
    or tied across stages are counted on one rank only. `groups` are the model-parallel groups whose
    partial sums add up to the whole model (tp, pp); data-parallel replicas hold the same numbers.
    """
    squares = torch.dot(flat.grads * norm_mask, flat.grads).reshape(1)
    for group in groups:
        if group.size > 1:
            squares = all_reduce(squares, group, in_place=True)
    return float(squares.sqrt())
