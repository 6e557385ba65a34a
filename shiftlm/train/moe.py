"""Mixture-of-experts training: the load-balancing loss in the training loss, on every layout
(docs/moe.md, "Training").

What one step adds (as transformers' `*ForCausalLM` adds it to its loss, and as its Trainer averages it
over micro-batches and data-parallel ranks): for each micro-batch of `train.micro_batch` sequences,
`router_aux_loss_coef * load_balancing_loss(that micro-batch)`, averaged over the step's
global_batch / micro_batch micro-batches. A micro-batch is transformers' batch whichever rank runs it,
so the loss is the same at any dp, ep, tp, pp, sp, cp and accumulation (for a fixed micro_batch).

The loss couples all MoE layers (counts and probability sums are added over layers before their
product), so with a pipeline the statistics travel with the activations: each stage appends its
layers' [counts, probability sums, rows] to the running sums and the last stage computes the loss;
autograd carries the probability sums' gradient back through the same messages (`RouterStatsStage`).
"""

from __future__ import annotations

import torch
from torch import nn

from shiftlm.comm import all_reduce
from shiftlm.config import ModelConfig
from shiftlm.mesh import Mesh
from shiftlm.model.moe import SparseMoE
from shiftlm.model.ops import PLAIN, Ops
from shiftlm.model.sharding import is_expert_param


def aux_loss_active(model: ModelConfig) -> bool:
    """transformers adds the load-balancing loss to the training loss when the config asks."""
    return model.is_moe and model.output_router_logits


def router_stats(stage: nn.Module, experts: int, device: torch.device) -> torch.Tensor:
    """[top-k counts (E), probability sums (E, with gradient), rows (1)] of the stage's MoE layers'
    last forward, summed over its layers (zeros for a stage without any)."""
    stats = [m.router_stats for m in stage.modules() if isinstance(m, SparseMoE) and m.router_stats]
    if not stats:
        return torch.zeros(2 * experts + 1, device=device)
    counts = torch.stack([s[0] for s in stats]).sum(dim=0)
    probs = torch.stack([s[1] for s in stats]).sum(dim=0)
    rows = torch.tensor([float(sum(s[2] for s in stats))], device=device)
    return torch.cat([counts.detach().float(), probs.float(), rows])


def aux_loss_share(stats: torch.Tensor, mesh: Mesh, coef: float, micro_batches: int) -> torch.Tensor:
    """This rank's share of `coef` x the step's mean load-balancing loss, from its micro-batch's
    `router_stats` (all MoE layers). Its value summed over dp x cp x sp is the step's term; its gradient
    is 1/TP of the term's (TP ranks route the same tokens and router gradients are summed over TP).

    The micro-batch's tokens are split over sp and cp (not dp: each dp rank's micro-batch is a batch
    of its own), so counts and rows are summed there; the counts carry no gradient, so each rank's
    term is E * sum_e count_e * probs_e(local) / R^2 (transformers' `load_balancing_loss_func`)."""
    experts = (stats.numel() - 1) // 2
    totals = torch.cat([stats[:experts], stats[2 * experts :]]).detach()
    for group in (mesh.sp, mesh.cp):
        totals = all_reduce(totals, group)
    counts, rows = totals[:experts], totals[experts]
    share = coef / micro_batches * experts * (counts * stats[experts : 2 * experts]).sum() / rows**2
    # the value in full (the loss is reported summed over dp x cp x sp, not tp), the gradient / TP
    return share.detach() + (share - share.detach()) / mesh.tp.size


def pack(hidden: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """One tensor for the pipeline executor: the activation, flattened, then the statistics (the
    receiver's `unpack` restores [B, S, H]). fp32: counts stay exact."""
    return torch.cat([hidden.float().reshape(-1), stats])


def unpack(
    packed: torch.Tensor, stats: int, batch: int, hidden_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states [batch, S, hidden_size], the `stats` statistics) of a `pack`ed tensor."""
    return packed[:-stats].view(batch, -1, hidden_size), packed[-stats:]


class RouterStatsStage(nn.Module):
    """A pipeline stage whose activations carry the running router statistics (see the module doc):
    the first stage takes token ids, the others a `pack`ed tensor; the last returns (its output,
    the statistics of the whole model), which `pipeline_aux_loss` turns into the loss."""

    def __init__(self, stage: nn.Module, sequences: int):
        """`sequences`: per micro-batch, the packed activation's batch dimension (not `micro_batch`,
        the attribute the pipeline executor sets on stages that take one)."""
        super().__init__()
        self.stage, self.sequences = stage, sequences
        self.experts = stage.config.num_experts

    def forward(self, x: torch.Tensor, ops: Ops = PLAIN):
        config, device = self.stage.config, self.stage.mesh.device
        if self.stage.with_embedding:
            hidden, running = x, torch.zeros(2 * self.experts + 1, device=device)
        else:
            hidden, running = unpack(x, 2 * self.experts + 1, self.sequences, config.hidden_size)
        out = self.stage(hidden, ops=ops)
        running = running + router_stats(self.stage, self.experts, device)
        if self.stage.with_head:
            return out, running
        return pack(out, running)


# -- expert parameters' own data group (`edp`) ------------------------------------------------------


def unit_labels_with_experts(names: list[str], labels: list[str] | None, apart: bool) -> list[str] | None:
    """The flat buffers' sharding units: `labels` (None: one unit; per layer at ZeRO-2/3), with each
    run of routed-expert parameters a unit of its own when the experts have groups of their own
    (`apart`: ep > 1 or etp != tp), so it can be reduced and sharded over `edp` (the ranks holding the
    same expert shards) while the rest go over `dp_sp`."""
    if not apart:
        return labels
    base = labels if labels is not None else [""] * len(names)
    return [f"{label}/experts" if is_expert_param(name) else label for label, name in zip(base, names)]


def unit_groups(flat, mesh: Mesh) -> list:
    """The data group of each unit of `flat`: `edp` for routed experts, `dp_sp` for the rest."""
    first = [flat.unit_of.index(unit) for unit in range(len(flat.units))]
    return [mesh.edp if is_expert_param(flat.slots[index].name) else mesh.dp_sp for index in first]
