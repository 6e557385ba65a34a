"""Per-GPU memory: weights, gradients and Adam state (ZeRO-sharded), plus activations.

States follow Rajbhandari et al. 2020 (ZeRO), Sec. 3.1: mixed-precision Adam keeps 2 bytes of
weights, 2 of gradients and 12 of fp32 master weights, momentum and variance per parameter; stage 1
shards the 12 over DP, stage 2 also the gradients, stage 3 also the weights.

Activations per layer per micro-batch follow Korthikanti et al. 2022, Sec. 4 (Table 2), generalised
to GQA and SwiGLU: `sbh(10 + 24/t) + 5as^2b/t` bytes with plain TP, everything over t with Megatron
SP, the 5as^2b score term dropped by selective recompute or FlashAttention, and only the layer input
(2sbh) kept under full recompute. Ulysses SP divides all of it by sp, context parallelism (ring attention) by cp. The number of micro-batches
alive at once comes from the simulated pipeline schedule, not from a formula.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from shiftlm.config import ModelConfig
from shiftlm.hardware import GIB
from shiftlm.sim.layout import Layout
from shiftlm.sim.moe import dispatched_rows, expert_layer_params, ffn_width, stage_expert_params, zero_sharded

# CUDA context, NCCL buffers, cuBLAS workspace and allocator fragmentation: a common rule of thumb.
RUNTIME_RESERVE_BYTES = 2.0 * GIB


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the busiest GPU."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    reserve: float
    capacity: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def as_dict(self) -> dict[str, float]:
        gib = {key: round(value / GIB, 2) for key, value in asdict(self).items()}
        return {**gib, "total": round(self.total / GIB, 2), "fits": self.fits}


def stage_params(model: ModelConfig, layout: Layout) -> float:
    """Parameters on the busiest pipeline rank (its layers plus an embedding or LM head), per TP shard."""
    layers_per_rank = model.num_layers / layout.pp
    # with pp > 1 the first rank holds the embedding and the last the LM head (Megatron keeps a
    # copy of tied embeddings on both); with pp = 1 one rank holds both unless they are tied
    embeddings = 1 if layout.pp > 1 or model.tie_word_embeddings else 2
    dense = model.layer_params - expert_layer_params(model)  # routed experts: 1/ep of them (sim/moe.py)
    stage = (layers_per_rank * dense + embeddings * model.embedding_params) / layout.tp
    return stage + stage_expert_params(model, layout)


def layer_activation_bytes(model: ModelConfig, layout: Layout, dtype_bytes: int = 2) -> float:
    """Activations one layer keeps for one micro-batch until its backward (Korthikanti Table 2)."""
    s, b, h, t = layout.seq_len / (layout.sp * layout.cp), layout.micro_batch, model.hidden_size, layout.tp
    if layout.recompute == "full":
        return dtype_bytes * s * b * h / (t if layout.sequence_parallel else 1)
    width = dtype_bytes / 2  # the paper counts fp16 (2 bytes) plus 1-byte dropout masks
    # norm inputs, linear inputs, dropout masks; a MoE layer's permuted rows (every tp rank's copy)
    replicated = s * b * h * (10 + 2 * dispatched_rows(model))
    ffn = ffn_width(model) * (3 if model.gated_mlp else 2) / h  # tensors in ffn width, in units of h
    kv = 2 * model.kv_dim / h
    sharded = s * b * h * (2 * (1 + kv) + 2 + 2 * ffn)  # q,k,v + attention out + MLP (= 24sbh for GPT)
    total = replicated / (t if layout.sequence_parallel else 1) + sharded / t
    if layout.recompute == "none" and not layout.flash_attention:
        total += 5 * model.num_heads * s * layout.seq_len * b / (t * layout.sp)  # (ring attention: no scores)
    return total * width


def working_set_bytes(model: ModelConfig, layout: Layout, dtype_bytes: int = 2) -> float:
    """Transient peak: full recompute rebuilds one layer's activations; the last stage's fp32 logits."""
    tokens = layout.micro_batch * layout.seq_len / (layout.sp * layout.cp)
    logits = 4 * tokens * model.vocab_size / layout.tp
    if layout.recompute != "full":
        return logits
    return logits + layer_activation_bytes(model, replace(layout, recompute="selective"), dtype_bytes)


def estimate_memory(
    model: ModelConfig, layout: Layout, peak_in_flight: float, capacity: float, dtype_bytes: int = 2
) -> MemoryEstimate:
    """Memory on the busiest rank; `peak_in_flight` = most stage-micro-batches (of L/(pp*chunks)
    layers each) whose activations one rank holds at once, from the simulated schedule."""
    params, experts = stage_params(model, layout), stage_expert_params(model, layout)
    dp = layout.dp * layout.cp * layout.sp  # the ZeRO group is the trainer's dp_sp (DP, cp, Ulysses)

    def sharded(stage: int) -> float:  # experts' states over their edp group
        return zero_sharded(params, experts, layout, dp, layout.zero >= stage)

    weights, gradients, optimizer = 2 * sharded(3), 2 * sharded(2), 12 * sharded(1)
    layers_per_chunk = model.num_layers / (layout.pp * layout.chunks)
    activations = peak_in_flight * layers_per_chunk * layer_activation_bytes(model, layout, dtype_bytes)
    activations += working_set_bytes(model, layout, dtype_bytes)
    return MemoryEstimate(weights, gradients, optimizer, activations, RUNTIME_RESERVE_BYTES, capacity)
