"""Mixture-of-experts feed-forward: top-k router, dropless grouped expert GEMMs, expert parallelism.

The layer computes what `transformers` computes for Mixtral, Qwen2-MoE and Qwen3-MoE (docs/moe.md):
router logits `x W_r^T`, softmax in fp32, `torch.topk` on the probabilities (so ties resolve as
transformers resolves them), optional renormalisation of the top-k (`norm_topk_prob`; Mixtral always),
then sum_k p_k * expert_k(x), plus Qwen2-MoE's shared expert scaled by sigmoid(x W_s^T).

Parameters keep the Hugging Face names (`mlp.experts.5.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.5.w1.weight`), one tensor per expert, so checkpoints map one-to-one; the
forward stacks this rank's experts for one grouped GEMM per projection (`torch._grouped_mm` where the
platform runs it, else one GEMM per expert over its contiguous rows).

Parallelism (Megatron-Core's MoE parallel folding, `mesh.expert_group_ranks`): with expert TP = TP (the
default) every expert's FFN is split over the TP group like the dense MLP (gate/up by rows, down by
columns; the outputs of the routed and shared experts are summed over TP once, by the layer's
row-parallel exit), and the experts are split over the `ep` group, folded over the ranks that see
different tokens (dp x cp x sp). Each ep rank routes its own tokens, sends each (token, choice) row to
the rank holding the chosen expert by one uneven all-to-all, computes, and returns the rows by the
inverse all-to-all. No token is dropped. With its own `etp` (!= tp) the routed experts run on the
stage's ranks re-cut as edp x ep x etp (`SparseMoE.folded`); the shared expert stays on TP.

The router and the shared-expert gate are replicated over TP but each TP rank sees only its share of
the experts' outputs, so their gradients are partial sums (`sharding.tp_partial_grad`, summed by
`grads.sync_tp_replicated_grads`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shiftlm.comm import (
    CommGroup,
    all_gather,
    all_reduce,
    all_to_all,
    all_to_all_rows,
    copy_to_group,
    gather_along,
    gather_replicated,
    reduce_from_group,
    reduce_scatter_along,
)
from shiftlm.config import ModelConfig
from shiftlm.errors import ConfigError
from shiftlm.model.moe_deterministic import SourceGrads, blockwise_swiglu

SEQ_DIM = 1

EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2")}  # (gate, up, down); the Qwen families use the MLP's names
MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


def ffn_name(config: ModelConfig, layer: int) -> str:
    """The attribute (and HF name) of layer `layer`'s feed-forward block."""
    return "block_sparse_moe" if config.model_type == "mixtral" and config.is_moe_layer(layer) else "mlp"


class _Weight(nn.Module):
    """A bare `.weight` (HF names a projection `<name>.weight`)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


class Expert(nn.Module):
    """One SwiGLU expert's three projections (this rank's `width` rows/columns of it), by their HF names."""

    def __init__(self, hidden: int, width: int, names: tuple[str, str, str]):
        super().__init__()
        self.names = names
        for name, shape in zip(names, ((width, hidden), (width, hidden), (hidden, width))):
            setattr(self, name, _Weight(*shape))

    def weights(self, full_tp=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """gate, up, down; with `full_tp` (serving's full-TP mode, attention.FullTP) sub-slice `part` of
        `parts` of this TP shard's width: views, no copies."""
        gate, up, down = (getattr(self, name).weight for name in self.names)
        if full_tp is None:
            return gate, up, down
        width = gate.shape[0] // full_tp.parts
        start = full_tp.part * width
        return gate.narrow(0, start, width), up.narrow(0, start, width), down.narrow(1, start, width)

    def forward(self, x: torch.Tensor, full_tp=None) -> torch.Tensor:
        gate, up, down = self.weights(full_tp)
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (`_grouped_mm`'s CPU backward rejects the
    stride-0 gradient a `.sum()` produces)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """`torch._grouped_mm` runs fp32 and bf16 on the CPU and bf16 on CUDA, with 16-byte aligned rows;
    under `torch.compile` bf16 only (its meta function, which tracing runs, refuses other dtypes)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False
    dtypes = (torch.float32, torch.bfloat16) if x.device.type == "cpu" else (torch.bfloat16,)
    aligned = all(
        w.shape[-1] * w.element_size() % 16 == 0 and w.shape[-2] * w.element_size() % 16 == 0 for w in weights
    )
    return x.dtype in dtypes and aligned and all(w.dtype == x.dtype for w in weights)


def expert_counts(choice: torch.Tensor, experts: int) -> torch.Tensor:
    """Rows per expert [experts] of the expert ids `choice` (all < experts). A scatter-add into a fixed
    size, not `bincount`, whose output size depends on the data: on a GPU it reads the maximum back
    to the host, a sync in every MoE layer of every step."""
    counts = torch.zeros(experts, dtype=torch.long, device=choice.device)
    return counts.scatter_add_(0, choice, torch.ones_like(choice))


def grouped_swiglu(
    x: torch.Tensor,
    rows: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    grouped: bool | None = None,
) -> torch.Tensor:
    """down_e(silu(gate_e x) * up_e x) for consecutive row groups: group e is `rows[e]` rows of `x`.

    gate/up: [E, F, H], down: [E, H, F]. One `_grouped_mm` per projection where supported (`grouped`
    None: decide), else one GEMM per expert over its slice (the same arithmetic)."""
    if grouped is None:
        grouped = grouped_mm_supported(x, gate, up, down)
    if grouped:
        offsets = torch.cumsum(rows, 0).to(torch.int32)

        def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return _ContiguousGrad.apply(torch._grouped_mm(a, w.transpose(1, 2), offs=offsets))

        return mm(F.silu(mm(x, gate)) * mm(x, up), down)
    return _per_expert_swiglu(x, rows, gate, up, down)


def _per_expert_swiglu(x, rows, gate, up, down) -> torch.Tensor:
    # eager in compiled blocks (traced, it specialised per row count); no decorator: it imports dynamo (1.2 s)
    if torch.compiler.is_compiling():
        return torch.compiler.disable(_per_expert_swiglu)(x, rows, gate, up, down)
    groups = enumerate(x.split(rows.tolist(), dim=0))
    parts = [F.linear(F.silu(F.linear(p, gate[e])) * F.linear(p, up[e]), down[e]) for e, p in groups]
    return torch.cat(parts, dim=0) if parts else x.new_zeros(0, down.shape[1])


class SparseMoE(nn.Module):
    """The routed experts (this ep rank's, split over etp: TP by default) and Qwen2-MoE's gated shared
    expert (split over TP).

    forward(x: this rank's tokens [B, S, H], split over TP along the sequence under Megatron sequence
    parallelism) enters the TP region as the dense MLP does, and leaves it with one sum over TP of the
    routed and shared experts' partial outputs. `router_stats` keeps the last forward's per-expert
    top-k counts and probability sums for the load-balancing loss (`load_balancing_loss`)."""

    def __init__(
        self,
        config: ModelConfig,
        tp: CommGroup,
        ep: CommGroup,
        sequence_parallel: bool = False,
        etp: CommGroup | None = None,
    ):
        """`etp`: the group splitting each routed expert's width (None: tp, expert TP = TP)."""
        super().__init__()
        h, experts = config.hidden_size, config.num_experts
        self.config, self.tp, self.ep, self.sequence_parallel = config, tp, ep, sequence_parallel
        self.etp = tp if etp is None else etp
        self.top_k = config.num_experts_per_tok
        self.local_experts = experts // ep.size
        self.first_expert = ep.rank * self.local_experts
        self.gate = _Weight(experts, h)
        names = EXPERT_NAMES.get(config.model_type, MLP_NAMES)
        width = config.moe_intermediate_size // self.etp.size
        self.experts = nn.ModuleDict(
            {
                str(e): Expert(h, width, names)
                for e in range(self.first_expert, self.first_expert + self.local_experts)
            }
        )
        if config.shared_expert_intermediate_size:
            self.shared_expert = Expert(h, config.shared_expert_intermediate_size // tp.size, MLP_NAMES)
            self.shared_expert_gate = _Weight(1, h)
        self.router_stats: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self.grouped: bool | None = None  # None: torch._grouped_mm where supported; False: per-expert GEMMs
        # with ep > 1: "all_to_all" (each row to its expert's rank), or "all_gather" (every rank gathers
        # all tokens, computes its experts' rows, and the outputs are reduce-scattered back; bench/moe.py)
        self.dispatch = "all_to_all"
        # `train.deterministic`: expert GEMMs per (source rank, expert) block (`blockwise_swiglu`), so the
        # step is the same bit for bit at any ep (docs/moe.md, "Bit-exact across ep")
        self.deterministic = False
        self.source_grads = SourceGrads()  # its expert weight gradients until the step's `flush`

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k weights [T, k] in x's dtype, expert indices [T, k]) of the rows of x, as transformers."""
        logits = F.linear(x, self.gate.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        if self.config.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        counts = expert_counts(index.flatten(), self.config.num_experts).to(probs.dtype)
        self.router_stats = (counts, probs.sum(dim=0), x.shape[0])
        return weights.to(x.dtype), index

    def forward(self, x: torch.Tensor, full_tp: object = None, ops: object = None) -> torch.Tensor:
        """`ops` (model/ops.py) is accepted for the layer's interface and not used: the router and the
        grouped expert GEMMs run autograd's ops in every mode (their weight gradients are never deferred)."""
        if full_tp is not None:
            # serving's full TP: every rank routes all the tokens (the same way: the router is replicated)
            # and computes sub-slice `part` of each expert's TP shard, summed over all P = SP x TP ranks
            if self.ep.size > 1:
                raise ConfigError(
                    "full-TP serving shards experts by width (expert TP), not over ep: use ep = 1"
                )
            return reduce_from_group(self.partial(x, full_tp), full_tp.group)
        if self.etp is not self.tp:
            return self.folded(x)
        if self.sequence_parallel:
            out = self.partial(gather_along(x, self.tp, SEQ_DIM))
            return reduce_scatter_along(out, self.tp, SEQ_DIM)
        return reduce_from_group(self.partial(copy_to_group(x, self.tp)), self.tp)

    def partial(self, x: torch.Tensor, full_tp: object = None) -> torch.Tensor:
        """This TP rank's share of the layer's output for the tokens x (the same on every TP rank); with
        `full_tp`, this rank's share of all P ranks'."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, index = self.route(x)
        out = self.routed(x, weights, index, full_tp)
        if hasattr(self, "shared_expert"):
            out = out + self.shared(x, full_tp)
        return out.view(shape)

    def routed(
        self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor, full_tp=None
    ) -> torch.Tensor:
        """sum_k weights_k * expert_{index_k}(x) for the rows of x (this rank's share of each expert's width)."""
        if self.ep.size > 1 and self.dispatch == "all_gather":
            return self.gathered_experts(x, weights, index)
        # one row per (token, choice), sorted by expert (stable: a token's choices keep their order)
        choice = index.flatten()
        order = torch.argsort(choice, stable=True)
        token = order // self.top_k
        rows = expert_counts(choice, self.config.num_experts)
        out = self.experts_forward(x[token], rows, full_tp) * weights.flatten()[order].unsqueeze(-1)
        return x.new_zeros(x.shape).index_add(0, token, out)

    def shared(self, x: torch.Tensor, full_tp=None) -> torch.Tensor:
        """Qwen2-MoE's gated shared expert on the rows of x (this TP rank's share of its width)."""
        gate = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight))
        return gate * self.shared_expert(x, full_tp)

    def folded(self, x: torch.Tensor) -> torch.Tensor:
        """The layer with its own expert TP (etp != tp; Megatron-Core's MoE parallel folding).

        The TP group routes its tokens as with expert TP = TP (so the router statistics, and the aux
        loss, are unchanged); each TP rank then hands the experts its 1/TP of them (its own sequence
        slice under Megatron SP), the etp group gathers its members' rows, the ep group dispatches them,
        each etp rank computes its 1/ETP of every expert's width, and a reduce-scatter over etp sums the
        partial outputs back to their rows; without SP the TP group all-gathers its shares again. The
        router's gradient on a rank is that of its own share (narrowed: zeros elsewhere), summed over TP
        as before. The shared expert is split over TP as the dense MLP."""
        tp, etp = self.tp, self.etp
        full = gather_along(x, tp, SEQ_DIM) if self.sequence_parallel else copy_to_group(x, tp)
        batch, seq, hidden = full.shape
        weights, index = self.route(full.reshape(-1, hidden))
        share = seq // tp.size

        def mine(t: torch.Tensor) -> torch.Tensor:  # this TP rank's sequence slice of per-token rows
            return t.view(batch, seq, -1).narrow(1, tp.rank * share, share).reshape(batch * share, -1)

        rows = gather_along(mine(full), etp, 0)
        out = self.routed(rows, gather_along(mine(weights), etp, 0), all_gather(mine(index), etp, 0))
        out = reduce_scatter_along(out, etp, 0).view(batch, share, hidden)
        if not self.sequence_parallel:
            out = gather_replicated(out, tp, SEQ_DIM)
        if not hasattr(self, "shared_expert"):
            return out
        shared = self.shared(full)
        if self.sequence_parallel:
            return out + reduce_scatter_along(shared, tp, SEQ_DIM)
        return out + reduce_from_group(shared, tp)

    def stacked_weights(self, full_tp: object = None) -> list[torch.Tensor]:
        """This rank's experts' gate, up and down weights stacked: [E_local, F, H], [E_local, F, H],
        [E_local, H, F] (with `full_tp`, sub-slice `part` of each width). After `stack_experts` views of
        the one stacked copy; otherwise stacked anew (a copy of every expert weight, per forward: what
        training needs, since its parameters are the separate HF tensors)."""
        stacked = getattr(self, "_stacked", None)
        if stacked is None:
            return [
                torch.stack(w) for w in zip(*(expert.weights(full_tp) for expert in self.experts.values()))
            ]
        if full_tp is None:
            return list(stacked)
        gate, up, down = stacked
        width = gate.shape[1] // full_tp.parts
        start = full_tp.part * width
        return [gate.narrow(1, start, width), up.narrow(1, start, width), down.narrow(2, start, width)]

    @torch.no_grad()
    def stack_experts(self) -> None:
        """Serving, once after loading: each projection's expert weights moved into one stacked tensor,
        the experts' parameters becoming its views, so a forward's grouped GEMMs read the weights in
        place instead of stacking a copy of every expert each step (the same memory: each old tensor
        is freed as its projection is stacked). The weights must not be replaced afterwards."""
        experts = list(self.experts.values())
        stacked = []
        for name in experts[0].names:
            params = [getattr(expert, name).weight for expert in experts]
            whole = torch.stack([p.detach() for p in params])
            for index, param in enumerate(params):
                param.data = whole[index]
            stacked.append(whole)
        self._stacked = tuple(stacked)

    def gathered_experts(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """All-gather dispatch (Megatron's AllGather token dispatcher): every ep rank gathers all ep ranks'
        tokens and routing (equal token counts), computes the rows routed to its own experts, and a
        reduce-scatter returns each rank the sum over experts of its tokens' outputs."""
        ep, local = self.ep, self.local_experts
        tokens = gather_along(x, ep, 0)
        gathered_weights = gather_along(weights, ep, 0)
        expert = all_gather(index, ep, 0) - self.first_expert
        mine = (expert >= 0) & (expert < local)
        choice = expert.masked_fill(~mine, local).flatten()  # other ranks' experts sort last
        keep = torch.argsort(choice, stable=True)[: int(mine.sum())]
        token = keep // self.top_k
        rows = expert_counts(choice[keep], local)
        y = grouped_swiglu(tokens[token], rows, *self.stacked_weights(), grouped=self.grouped)
        y = y * gathered_weights.flatten()[keep].unsqueeze(-1)
        return reduce_scatter_along(tokens.new_zeros(tokens.shape).index_add(0, token, y), ep, 0)

    def experts_forward(self, x: torch.Tensor, rows: torch.Tensor, full_tp: object = None) -> torch.Tensor:
        """Rows sorted by expert (`rows[e]` for expert e, all experts) -> each through its expert."""
        if self.ep.size == 1:
            return self.local_experts_forward(x, rows.view(1, -1), full_tp)
        ep, local = self.ep, self.local_experts
        # how many rows each rank sends me per local expert: [ep, local]
        received = all_to_all(rows.view(ep.size, local).contiguous(), ep, scatter_dim=0, gather_dim=0)
        send = rows.view(ep.size, local).sum(dim=1).tolist()
        recv = received.sum(dim=1).tolist()
        arrived = all_to_all_rows(x, ep, send, recv)  # by source rank, then by expert
        return all_to_all_rows(self.local_experts_forward(arrived, received), ep, recv, send)

    def local_experts_forward(
        self, x: torch.Tensor, counts: torch.Tensor, full_tp: object = None
    ) -> torch.Tensor:
        """Rows ordered by (source rank, expert), `counts[s, e]` of them ([sources, E_local]) -> each
        through this rank's expert e, in the same order."""
        if self.deterministic:
            weights = [expert.weights(full_tp) for expert in self.experts.values()]
            return blockwise_swiglu(x, counts, weights, self.source_grads)
        stacked = self.stacked_weights(full_tp)
        if counts.shape[0] == 1:
            return grouped_swiglu(x, counts[0], *stacked, grouped=self.grouped)
        local = self.local_experts
        expert_of_row = (
            torch.arange(local, device=x.device).repeat(counts.shape[0]).repeat_interleave(counts.flatten())
        )
        by_expert = torch.argsort(expert_of_row, stable=True)
        y = grouped_swiglu(x[by_expert], counts.sum(dim=0), *stacked, grouped=self.grouped)
        return y[torch.argsort(by_expert)]  # back to (source rank, expert) order


def load_balancing_loss(
    moe_layers: list[SparseMoE], tokens: CommGroup, tp: CommGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `load_balancing_loss_func` (Switch Transformer's auxiliary loss) over the whole
    batch, computed from every rank's share: (this rank's term to add to its loss, the global value).

    E * sum_e (top-k count_e / R) * (probability sum_e / R), counts and sums over all MoE layers and all
    R = layers x tokens rows of the global batch. The counts carry no gradient, so the loss is a sum of
    per-rank terms `E * sum_e count_e * p_e(local) / R^2` once the counts and R are summed over the token
    ranks (`tokens`: dp x cp x sp); each TP rank routes the same tokens and its gradients are summed
    over TP, hence the 1/TP on its term."""
    stats = [layer.router_stats for layer in moe_layers if layer.router_stats is not None]
    if not stats:
        raise ValueError("load_balancing_loss needs a forward pass through the MoE layers first")
    counts = torch.stack([s[0] for s in stats]).sum(dim=0)
    probs = torch.stack([s[1] for s in stats]).sum(dim=0)
    rows = torch.tensor([float(sum(s[2] for s in stats))], dtype=counts.dtype, device=counts.device)
    counts, rows = all_reduce(counts.clone(), tokens), all_reduce(rows, tokens)
    experts = counts.numel()
    local = experts * (counts * probs).sum() / rows[0] ** 2
    value = all_reduce(local.detach().reshape(1).clone(), tokens)[0]
    return local / tp.size, value
