"""AdamW over ZeRO shards (Rajbhandari et al. 2020, ZeRO §5: P_os, P_os+g, P_os+g+p).

The flat buffers (`flat.py`) are cut into sharding units; rank r of the data group owns the r-th
1/N of every unit (one unit, the whole buffer, below stage 3; one per decoder layer at stage 3).
- stage 0: every rank keeps all Adam moments and updates everything itself.
- stage 1 (P_os): gradients are all-reduced; each rank keeps the moments of its range, updates it,
  and an all-gather refills the full parameters everywhere.
- stage 2 (P_os+g): gradients are sharded (`grad_shards.ShardedGrads`): each unit's gradient is
  reduce-scattered as soon as it is complete and each rank keeps only the sum of its own range,
  which is all the update needs; the rest as in stage 1.
- stage 3 (P_os+g+p): parameters are sharded at rest too (`zero3.ParameterShards`): the update
  writes the fp32 master shard, and layers are all-gathered just before use.
The arithmetic per element is the same at every stage, so all give the same parameters (up to the
summation order of the reductions).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from shiftlm.comm import CommGroup, all_gather_flat, all_reduce
from shiftlm.model.compile import compile_usable
from shiftlm.train.config import OptimSection
from shiftlm.train.flat import FlatParameters
from shiftlm.train.optim import adamw_update
from shiftlm.train.zero3 import ParameterShards, unit_labels


def owned_ranges(
    flat: FlatParameters, groups: CommGroup | list[CommGroup], sharded: bool
) -> list[tuple[int, int]]:
    """[start, end) of every range of the flat buffers this rank owns: its 1/N of each unit, N the
    unit's group (`groups`: one for all units, or one per unit)."""
    if not sharded:
        return [(0, flat.padded)]
    if isinstance(groups, CommGroup):
        groups = [groups] * len(flat.units)
    ranges = []
    for (offset, length), group in zip(flat.units, groups):
        size = length // group.size
        ranges.append((offset + group.rank * size, offset + (group.rank + 1) * size))
    return ranges


class ShardedAdamW:
    def __init__(
        self,
        flat: FlatParameters,
        group: CommGroup,
        optim: OptimSection,
        decay_mask,
        shard: bool | None = None,
        stage: int | None = None,
        unit_groups: list[CommGroup] | None = None,
    ):
        """`stage`: the ZeRO stage (0-3); `shard` (older form) means stage 1 when true. `decay_mask`:
        a full-size flat 0/1 tensor, or `keep(name, shape)` (then only the owned ranges are built).
        `unit_groups`: each unit's data group where they differ (routed experts shard over `edp`);
        `group` (`dp_sp`) covers every element once either way, as the gradient norm needs."""
        self.flat, self.group, self.optim = flat, group, optim
        self.unit_groups = unit_groups if unit_groups is not None else [group] * len(flat.units)
        self.stage = stage if stage is not None else int(bool(shard))
        self.sharded = self.stage >= 1 and group.size > 1
        self.ranges = owned_ranges(flat, self.unit_groups, self.sharded)
        if callable(decay_mask):
            self.decay_mask = flat.mask(decay_mask, self.ranges)
        else:
            self.decay_mask = torch.cat([decay_mask[a:b] for a, b in self.ranges])
        size = sum(b - a for a, b in self.ranges)
        self.exp_avg = torch.zeros(size, device=flat.device)  # fp32 moments next to the fp32 master
        self.exp_avg_sq = torch.zeros(size, device=flat.device)
        self.grad_shard: torch.Tensor | None = None  # ZeRO-2/3: the gradients, laid out like the moments
        self.step_count = 0
        self.fused = compile_usable(optim.fused, flat.device, "optim.fused")  # one compiled update kernel
        self.shards = None  # stage 3: the ParameterShards holding the fp32 master shards
        self._refill: dict[int, torch.Tensor] = {}  # stages 1-2: the all-gather's input copy per unit

    def shard_parameters(self, stages: list[torch.nn.Module]) -> None:
        """ZeRO-3: keep only this rank's master shards at rest and gather each unit of `stages` (in
        the flat buffers' order) around its use (`zero3.ParameterShards`)."""
        if self.stage < 3 or not self.sharded:
            return
        self.shards = ParameterShards(self.flat, self.unit_groups, self.ranges)
        labels = unit_labels([slot.name for slot in self.flat.slots])
        stage_units, index = [], 0
        for stage in stages:  # per module (embedding, layer, norm, head): its units (a layer's experts')
            count = len(list(stage.parameters()))
            modules: list[list[int]] = []
            for i in range(index, index + count):
                unit = self.flat.unit_of[i]
                if modules and modules[-1][-1] == unit:
                    continue
                if modules and labels[i] == labels[i - 1]:
                    modules[-1].append(unit)
                else:
                    modules.append([unit])
            stage_units.append(modules)
            index += count
        tied = [
            stage.with_head and stage.with_embedding and not hasattr(stage, "lm_head") for stage in stages
        ]
        self.shards.wrap(stages, stage_units, tied)

    def gathered(self, write_back: bool = False):
        """A context in which every parameter is present (ZeRO-3 gathers them; else nothing to do)."""
        return self.shards.gathered(write_back) if self.shards is not None else nullcontext()

    def _pieces(self):
        """(range, offset in the moment buffers) of each owned range."""
        offset = 0
        for a, b in self.ranges:
            yield a, b, offset
            offset += b - a

    @torch.no_grad()
    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """Update the parameters with their (already synced) gradients times `grad_scale` (clipping)."""
        self.step_count += 1
        for index, (a, b, offset) in enumerate(self._pieces()):
            moments = slice(offset, offset + b - a)
            grad = self.grad_shard[moments] if self.grad_shard is not None else self.flat.grads[a:b]
            if grad_scale != 1.0:
                grad = grad * grad_scale
            params = self.shards.master[index] if self.shards is not None else self.flat.params[a:b]
            adamw_update(
                params,
                grad,
                self.exp_avg[moments],
                self.exp_avg_sq[moments],
                self.decay_mask[moments],
                self.step_count,
                lr,
                self.optim,
                self.fused,
            )
        if self.sharded and self.shards is None:  # stages 1 and 2: refill the full parameters
            units = zip(self.flat.units, self.ranges, self.unit_groups)
            for index, ((offset, length), (a, b), group) in enumerate(units):
                # all_gather may not read from a view of its output: a copy, into one buffer kept for
                # the run (a fresh clone per step was held by gloo's finished work into the next step,
                # 0-3 of them at a time: peaks varied by 3 shards between identical runs)
                if index not in self._refill:
                    self._refill[index] = torch.empty_like(self.flat.params[a:b])
                shard = self._refill[index]
                shard.copy_(self.flat.params[a:b])
                all_gather_flat(self.flat.params[offset : offset + length], shard, group)

    def _gather(self, moment: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return moment.clone()
        full = self.flat.zeros()
        for (offset, length), (a, b, start), group in zip(self.flat.units, self._pieces(), self.unit_groups):
            all_gather_flat(full[offset : offset + length], moment[start : start + b - a].contiguous(), group)
        return full

    def full_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Layout-free moments: per parameter name, full local-shape tensors (collective over the group)."""
        return {
            "exp_avg": self.flat.unflatten(self._gather(self.exp_avg)),
            "exp_avg_sq": self.flat.unflatten(self._gather(self.exp_avg_sq)),
        }

    def load_full_state(self, state: dict[str, dict[str, torch.Tensor]], step_count: int) -> None:
        """Inverse of `full_state`: keep this rank's ranges of each moment."""
        for name, target in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
            full = self.flat.flatten(state[name])
            target.copy_(torch.cat([full[a:b] for a, b in self.ranges]))
        self.step_count = step_count


def _masked_squares(grads: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(mask * grads^2), by `sum`'s pairwise (cascade, on the CPU; tree, on CUDA) reduction. Not
    `torch.dot`: MKL's sdot adds into a few running fp32 sums, so over a buffer of 3e5 squares spread
    over many orders of magnitude the small ones are rounded away (one rank's stand-in norm of
    `--dry-run` came out 7.8e-5 low against fp64; the layouts, summing 1/N of it per rank, 2e-6)."""
    return (grads * mask).mul_(grads).sum()


@torch.no_grad()
def global_grad_norm(
    flat: FlatParameters,
    norm_mask: torch.Tensor,
    groups: list[CommGroup],
    optimizer: ShardedAdamW | None = None,
    experts: tuple[torch.Tensor, list[CommGroup], float] | None = None,
) -> float:
    """The L2 norm of the whole model's gradient (all stages, all TP shards), counted once per element.

    `norm_mask` is 1 on the elements this rank counts: parameters replicated over TP (norm weights)
    or tied across stages are counted on one rank only. `groups` are the model-parallel groups whose
    partial sums add up to the whole model (tp, pp); data-parallel replicas hold the same numbers,
    except at ZeRO stage >= 2 (`optimizer` given), where each holds the sum of its own ranges only:
    then those ranges are counted and the data group is summed over too. With sharded gradients
    (`optimizer.grad_shard`) `norm_mask` is shard-sized (`flat.mask(keep, optimizer.ranges)`).
    `experts` (ep > 1 or etp != tp): (the mask of the routed experts' elements, laid out as
    `norm_mask`, which then leaves them out; the groups their squares are summed over where the data
    group is not summed: `ep`, and `etp` when it is not tp; this rank's weight of that sum, 0 on all
    but tp rank 0 then). Sharded, the data group x tp covers each expert element once.
    """
    if optimizer is not None and optimizer.grad_shard is not None:
        grads = optimizer.grad_shard
        squares = _masked_squares(grads, norm_mask).reshape(1)
        if experts is not None:
            squares = squares + _masked_squares(grads, experts[0])
        groups = [*groups, optimizer.group]
    elif optimizer is not None and optimizer.stage >= 2 and optimizer.sharded:
        masks = [norm_mask] if experts is None else [norm_mask, experts[0]]
        squares = sum(
            _masked_squares(flat.grads[a:b], mask[a:b]) for a, b in optimizer.ranges for mask in masks
        ).reshape(1)
        groups = [*groups, optimizer.group]
    else:
        squares = _masked_squares(flat.grads, norm_mask).reshape(1)
        if experts is not None:
            mask, expert_groups, weight = experts
            expert_squares = _masked_squares(flat.grads, mask).reshape(1)
            for group in expert_groups:
                expert_squares = all_reduce(expert_squares, group)
            squares = squares + (expert_squares if weight == 1.0 else expert_squares * weight)
    for group in groups:
        if group.size > 1:
            squares = all_reduce(squares, group, in_place=True)
    return float(squares.sqrt())
