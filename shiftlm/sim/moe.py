"""Mixture of experts in the simulator: expert GEMMs at their real sizes, the ep group's all-to-alls
and where they run, expert parameters sharded over ep (and their optimizer state over edp).

Expert parallelism is folded over the ranks that see different tokens (docs/moe.md; Megatron-Core's
MoE parallel folding, Liu et al. 2025, arXiv 2504.14960): token rank f = (dp*CP + cp)*SP + sp is ep
rank f % EP of ep group f // EP, and every expert's FFN is split over tp (expert TP = TP). A replay
of Megatron-Core with expert TP 1 (`Layout.expert_tp = 1`, its `--expert-tensor-parallel-size 1`)
folds ep over the tp ranks too (innermost), each tp rank dispatching its own 1/tp of the tokens
(Megatron sequence parallelism). shiftlm's planner proposes expert TP = TP only: the trainer has no
separate etp.

Per MoE layer and micro-batch, on one rank holding E/ep experts (balanced routing, dropless):
- dispatch: route `T` tokens to top-k experts, permute T*k rows (bytes: read T*h, write T*k*h),
  all-to-all them to the experts' ranks, and after the experts the inverse all-to-all and the
  weighted un-permute (the same bytes). Each all-to-all moves T*k*h*bytes*(ep-1)/ep per rank
  (`collectives.all_to_all_time`, NVLink or NIC by where the ep group lies); the backward runs two
  more, as the conjugates (`costs.layer_pass_costs` adds a layer's forward collectives to its I).
- expert GEMMs: each local expert sees T*k*ep/E rows (T*k rows per rank in all); one grouped GEMM per
  projection (`torch._grouped_mm` here, Megatron-Core's GroupedGEMM), timed by the roofline at the
  per-expert shape: with few rows a GEMM reads its weights for little work and turns memory-bound
  (`costs.kernels_time`), and a calibrated profile's measured rate of that shape applies. No
  fitted constant is added for small GEMMs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shiftlm.config import ModelConfig

if TYPE_CHECKING:  # layout.py checks expert layouts with the helpers here
    from shiftlm.sim.layout import Layout


def moe_share(model: ModelConfig) -> float:
    """The share of layers that route to experts (qwen2_moe may keep dense MLPs in some)."""
    return model.moe_layers / model.num_layers if model.is_moe else 0.0


def expert_layer_params(model: ModelConfig) -> float:
    """Routed experts' parameters of a layer, averaged over the layers: what ep shards. The router
    and the shared expert are replicated over ep like attention."""
    if not model.is_moe:
        return 0.0
    matrices = 3 if model.gated_mlp else 2
    per_expert = matrices * model.hidden_size * model.moe_intermediate_size
    return model.num_experts * per_expert * moe_share(model)


def expert_tp(layout: Layout) -> int:
    """The tp degree that splits each expert: the layout's tp unless a replay sets expert_tp."""
    return layout.expert_tp or layout.tp


def folded_axes(layout: Layout) -> tuple[str, ...]:
    """The axes ep is folded over, innermost first."""
    over_tp = layout.tp > 1 and expert_tp(layout) == 1
    return ("tp",) * over_tp + ("sp", "cp", "dp")


def token_ranks(layout: Layout) -> int:
    """Ranks that dispatch different tokens (ep x edp)."""
    ranks = 1
    for axis in folded_axes(layout):
        ranks *= layout.size(axis)
    return ranks


def _placement(layout: Layout, folded: range, gpus_per_node: int) -> tuple[int, int]:
    """(ranks per node, nodes) of the ranks at folded indices `folded` (tp = pp = 0 otherwise)."""
    ranks = []
    for f in folded:
        rank = 0
        for axis in folded_axes(layout):
            rank += (f % layout.size(axis)) * layout.stride(axis)
            f //= layout.size(axis)
        ranks.append(rank)
    nodes = len({rank // gpus_per_node for rank in ranks})
    return len(ranks) // nodes, nodes


def ep_placement(layout: Layout, gpus_per_node: int) -> tuple[int, int]:
    """(ranks per node, nodes) of one ep group: its all-to-alls run on NVLink inside a node and on
    the NICs across nodes."""
    return _placement(layout, range(layout.ep), gpus_per_node)


def edp_placement(layout: Layout, gpus_per_node: int) -> tuple[int, int]:
    """(ranks per node, nodes) of one expert data-parallel group (the ranks holding the same
    experts, over which expert gradients are summed): every ep-th token rank."""
    return _placement(layout, range(0, token_ranks(layout), layout.ep), gpus_per_node)


def dispatch_tokens(layout: Layout) -> float:
    """Tokens one rank routes per micro-batch."""
    tokens = layout.micro_batch * layout.seq_len / (layout.sp * layout.cp)
    return tokens / layout.tp if "tp" in folded_axes(layout) else tokens


def dispatch_bytes(model: ModelConfig, layout: Layout, dtype_bytes: int) -> float:
    """Bytes one rank hands to one dispatch (or combine) all-to-all: its T*k rows of hidden size."""
    return dispatch_tokens(layout) * model.num_experts_per_tok * model.hidden_size * dtype_bytes


def stage_expert_params(model: ModelConfig, layout: Layout) -> float:
    """Routed-expert parameters on the busiest pipeline rank: 1/ep of the experts, each split over
    the expert tp."""
    return model.num_layers / layout.pp * expert_layer_params(model) / (layout.ep * expert_tp(layout))


def zero_sharded(stage: float, expert: float, layout: Layout, data_group: int, shard: bool) -> float:
    """Parameters of a rank's state after ZeRO sharding (`shard`): the dense ones over the data group,
    the experts' over their edp group (data group / ep)."""
    if not shard:
        return stage
    return (stage - expert) / data_group + expert * layout.ep / token_ranks(layout)


def ffn_width(model: ModelConfig) -> float:
    """FFN activation width per token, averaged over layers: the dense MLP's, or the top-k experts'
    plus the shared expert's in a MoE layer."""
    if not model.is_moe:
        return model.intermediate_size
    moe = model.num_experts_per_tok * model.moe_intermediate_size + model.shared_expert_intermediate_size
    share = moe_share(model)
    return share * moe + (1 - share) * model.intermediate_size


def dispatched_rows(model: ModelConfig) -> float:
    """Hidden-size rows per token a MoE layer keeps for backward (the permuted input and the experts'
    output, top-k each), averaged over layers."""
    return 2 * model.num_experts_per_tok * moe_share(model)
