"""Mixture of experts in the simulator: expert GEMMs at their real sizes, the ep group's all-to-alls
and where they run, expert parameters sharded over ep (and their optimizer state over edp).

The experts' layout is folded over each stage's ranks as the trainer folds it (docs/moe.md;
Megatron-Core's MoE parallel folding, Liu et al. 2025, arXiv 2504.14960): stage position
r = f*TP + tp (token rank f = (dp*CP + cp)*SP + sp) is cut as r = (edp*EP + ep)*ETP + etp. With
ETP = TP (`etp` 0, expert TP = TP) token rank f is ep rank f % EP of ep group f // EP; with ETP < TP
(Megatron-Core's `--expert-tensor-parallel-size 1` in the replays, or a planned `etp`) ep spans tp
ranks too, each tp rank dispatching its 1/tp of the tokens gathered over its etp group. The etp
group's all-gather of the dispatched tokens and reduce-scatter of the outputs are priced where
etp != tp (`etp_exchange_bytes`).

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

from math import comb
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


STAGE_AXES = ("tp", "sp", "cp", "dp")  # a stage position r = f*TP + tp, innermost first


def token_ranks(layout: Layout) -> int:
    """Ranks that dispatch different tokens (ep x edp): the stage's ranks over the etp groups."""
    return layout.dp * layout.cp * layout.sp * layout.tp // layout.expert_tp


def _placement(layout: Layout, positions: range, gpus_per_node: int) -> tuple[int, int]:
    """(ranks per node, nodes) of the ranks at stage positions `positions` (pp = 0)."""
    ranks = []
    for r in positions:
        rank = 0
        for axis in STAGE_AXES:
            rank += (r % layout.size(axis)) * layout.stride(axis)
            r //= layout.size(axis)
        ranks.append(rank)
    nodes = len({rank // gpus_per_node for rank in ranks})
    return len(ranks) // nodes, nodes


def ep_placement(layout: Layout, gpus_per_node: int) -> tuple[int, int]:
    """(ranks per node, nodes) of one ep group (stride ETP): its all-to-alls run on NVLink inside a
    node and on the NICs across nodes."""
    etp = layout.expert_tp
    return _placement(layout, range(0, layout.ep * etp, etp), gpus_per_node)


def etp_placement(layout: Layout, gpus_per_node: int) -> tuple[int, int]:
    """(ranks per node, nodes) of one etp group (ETP consecutive stage positions)."""
    return _placement(layout, range(layout.expert_tp), gpus_per_node)


def edp_placement(layout: Layout, gpus_per_node: int) -> tuple[int, int]:
    """(ranks per node, nodes) of one expert data-parallel group (the ranks holding the same
    expert shards, over which expert gradients are summed): stride EP x ETP."""
    step = layout.ep * layout.expert_tp
    return _placement(layout, range(0, step * (token_ranks(layout) // layout.ep), step), gpus_per_node)


def dispatch_tokens(layout: Layout) -> float:
    """Tokens one rank dispatches per micro-batch: its tp group's, or with etp != tp its 1/tp of
    them gathered over its etp group."""
    tokens = layout.micro_batch * layout.seq_len / (layout.sp * layout.cp)
    return tokens * layout.expert_tp / layout.tp


def etp_exchange_bytes(model: ModelConfig, layout: Layout, dtype_bytes: int) -> float:
    """Bytes of the etp group's all-gather of the dispatched tokens (and of the outputs'
    reduce-scatter) per MoE layer and micro-batch, where etp != tp; 0 with expert TP = TP."""
    if layout.expert_tp == layout.tp:
        return 0.0
    return dispatch_tokens(layout) * model.hidden_size * dtype_bytes


def dispatch_bytes(model: ModelConfig, layout: Layout, dtype_bytes: int) -> float:
    """Bytes one rank hands to one dispatch (or combine) all-to-all: its T*k rows of hidden size."""
    return dispatch_tokens(layout) * model.num_experts_per_tok * model.hidden_size * dtype_bytes


def stage_expert_params(model: ModelConfig, layout: Layout) -> float:
    """Routed-expert parameters on the busiest pipeline rank: 1/ep of the experts, each split over
    the expert tp."""
    return model.num_layers / layout.pp * expert_layer_params(model) / (layout.ep * layout.expert_tp)


def zero_sharded(stage: float, expert: float, layout: Layout, data_group: int, shard: bool) -> float:
    """Parameters of a rank's state after ZeRO sharding (`shard`): the dense ones over the data group,
    the experts' over their edp group (the stage's ranks / (ep x etp))."""
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


def remote_nodes_per_token(model: ModelConfig, nodes: int) -> float:
    """Expected number of other nodes a token's top-k experts lie on, for an ep group over `nodes`
    nodes holding E/nodes experts each and balanced (uniform, without replacement) routing:
    (nodes - 1) x (1 - C(E - E/nodes, k) / C(E, k))."""
    if nodes <= 1:
        return 0.0
    experts, k = model.num_experts, model.num_experts_per_tok
    untouched = comb(experts - experts // nodes, k) / comb(experts, k)
    return (nodes - 1) * (1 - untouched)


def deepep_dispatch_bytes(model: ModelConfig, layout: Layout, dtype_bytes: int, nodes: int) -> float:
    """Bytes one rank sends over its NIC in one DeepEP dispatch (or combine) across nodes: DeepEP's
    normal kernels send a token once to each other node that holds any of its top-k experts and
    forward it there over NVLink (github.com/deepseek-ai/DeepEP, docs/legacy.md: "kernels optimized
    for asymmetric-domain bandwidth forwarding, such as forwarding data from NVLink domain to RDMA
    domain"; its benchmark counts the RDMA bytes as the node-deduplicated tokens x hidden), where an
    all-to-all sends every remote top-k row: T x remote nodes per token x h, against T x k x
    (n - local)/n x h."""
    return dispatch_tokens(layout) * remote_nodes_per_token(model, nodes) * model.hidden_size * dtype_bytes


def deepep_time(
    model: ModelConfig,
    layout: Layout,
    dtype_bytes: int,
    per_node: int,
    nodes: int,
    intra_bandwidth: float,
    rdma_bandwidth: float,
    latency: float,
) -> float:
    """One DeepEP dispatch (or combine) of an ep group of `per_node` ranks on each of `nodes` nodes:
    the node-deduplicated rows over the NIC at `rdma_bandwidth` while every row's NVLink hop inside
    its node (all T x k rows but the 1/per_node already on their GPU) runs at `intra_bandwidth`."""
    rdma = deepep_dispatch_bytes(model, layout, dtype_bytes, nodes)
    nvlink = dispatch_bytes(model, layout, dtype_bytes) * (per_node - 1) / per_node
    return latency + max(nvlink / intra_bandwidth, rdma / rdma_bandwidth)


# Host (framework) ops one Megatron-Core MoE layer issues in its forward, counted from
# megatron/core/transformer/moe/ at main 1e057005 (the revision the Qwen3 TP4 EP8 row names) with the
# Qwen3-235B recipe's flags (Megatron-MoE-ModelZoo c1ad0b5, model_configs/benchmarking/
# Qwen3-235B-A22B.yaml: `--moe-token-dispatcher-type flex --moe-enable-deepep --moe-permute-fusion
# --enable-experimental --moe-router-load-balancing-type aux_loss --moe-router-dtype fp32
# --moe-grouped-gemm`, Transformer Engine; `--moe-router-fusion` is listed there too but does not
# exist at 1e057005, so the router runs unfused), each framework call counted once as
# `efficiency.LAYER_OPS_FORWARD` counts a GPT layer's:
MCORE_MOE_OPS = {
    # router.py `gating` + `routing`: input.to(fp32), weight.to(fp32), linear, logits.view
    "router_gating": 4,
    # moe_utils.py `topk_softmax_with_capacity` (no pre-softmax, no capacity): topk, softmax, type_as,
    # zeros_like, scatter, zeros_like, int, scatter, bool, sum(dim=0)
    "router_topk": 10,
    # router.py `aux_loss_load_balancing` / `apply_load_balancing_loss`, moe_utils.py
    # `switch_load_balancing_loss_func`, `save_to_aux_losses_tracker`: softmax for the aux scores,
    # sum(dim=0), mul, sum, mul, loss / coeff, detach, tracker index, +=, MoEAuxLossAutoScaler.apply
    # (and an all_reduce of tokens_per_expert over the tp x cp group where that group is > 1)
    "router_aux_loss": 10,
    # token_dispatcher.py `MoEFlexTokenDispatcher.token_permutation`, `_initialize_metadata`,
    # `_DeepepManager.setup_metadata`: view, (reshape, expand, reshape, contiguous) for the routing
    # map and the probs, two reshapes, topk
    "dispatch_metadata": 12,
    # fused_a2a.py `FusedDispatch.forward`: contiguous, Function.apply, DeepEP get_dispatch_layout,
    # DeepEP dispatch (notify kernel, then the host waits for the received counts, dispatch kernel),
    # torch.tensor(num_recv_tokens_per_expert_list)
    "deepep_dispatch": 6,
    # `_DeepepManager.get_permuted_hidden_states_by_experts`: fused_indices_to_multihot, the host
    # sum of tokens_per_expert, TE's fused_permute_with_probs (row-id map, permute, their outputs)
    "permute": 6,
    # experts.py `TEGroupedMLP.forward` outside the per-expert GEMMs: tokens_per_expert.tolist(),
    # probs.unsqueeze, weighted_bias_swiglu, and per grouped linear (fc1, fc2) TE `_GroupedLinear`'s
    # torch.split of the input and its output torch.empty
    "experts": 7,
    # `get_restored_hidden_states_by_experts` (TE fused_unpermute and its output), fused_a2a.py
    # `FusedCombine` (Function.apply, DeepEP combine), the final view
    "unpermute_combine": 5,
}
# TE `general_grouped_gemm` issues one cuBLAS GEMM per local expert per grouped linear (fc1, fc2)
MCORE_MOE_GEMMS_PER_EXPERT = 2
# the dense MLP ops of `LAYER_OPS_FORWARD` a MoE layer replaces: fc1, bias-GeLU, fc2
DENSE_MLP_OPS = 3


def megatron_core_moe_layer_ops(model: ModelConfig, layout: Layout, gpt_layer_ops: float) -> float:
    """Host ops of one layer's forward, averaged over the layers, where the MoE layers are
    Megatron-Core's (`MCORE_MOE_OPS`): a GPT layer's `gpt_layer_ops` with the dense MLP's ops replaced
    by the MoE layer's, whose grouped linears issue a GEMM per local expert (E/ep)."""
    if not model.is_moe:
        return gpt_layer_ops
    ops = sum(MCORE_MOE_OPS.values())
    if layout.tp * layout.cp > 1:
        ops += 1  # the aux loss's all_reduce of tokens_per_expert over the tp x cp group
    ops += MCORE_MOE_GEMMS_PER_EXPERT * model.num_experts / layout.ep
    moe_layer = gpt_layer_ops - DENSE_MLP_OPS + ops
    share = moe_share(model)
    return share * moe_layer + (1 - share) * gpt_layer_ops
