"""Per-layer compute cost on one GPU: FLOPs and HBM bytes of every kernel, timed by a roofline.

A kernel takes `max(flops / (peak * gemm), bytes / (hbm * memory)) + kernel_overhead`: large GEMMs
are compute-bound, norms/activations/dropout are memory-bound, and attention without FlashAttention
is in between (its batched GEMMs have K = head_dim). FLOP counts follow Narayanan et al. 2021,
Appendix ("24bsh^2 + 4bs^2h" per layer forward for GPT), generalised to GQA and SwiGLU; elementwise
bytes follow the tensors Korthikanti et al. 2022, Sec. 4.1 enumerates (the 34sbh + 5as^2b terms).

`forward_ops` is the one place a transformer layer's work is described. Training composes it into
F / I / W costs per micro-batch (`layer_pass_costs`); a serving cost-model runner can call
`forward_ops` with `query_tokens` new tokens against `kv_tokens` of context (prefill or decode) and
`kernels_time` to time them, plus `layer_comm_time` for the TP all-reduces / Ulysses all-to-alls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from shiftlm.config import ModelConfig
from shiftlm.hardware import Hardware
from shiftlm.parallel import ParallelConfig
from shiftlm.sim.collectives import Links, all_reduce_time, all_to_all_time
from shiftlm.sim.efficiency import LAYER_OPS_BACKWARD, LAYER_OPS_FORWARD, Efficiency
from shiftlm.sim.moe import moe_share

INFERENCE_ROLE = "inference"  # a serving engine's forward GEMM (`shiftlm calibrate` times the engine's own)


@dataclass(frozen=True)
class Kernel:
    """One GPU kernel: `gemm` kernels run at tensor-core efficiency, the rest at HBM efficiency.
    A GEMM with a `shape` (m, k, n of its forward, y[m, n] = x[m, k] W^T) runs at the hardware's
    measured rate for that shape and `role` where the profile has a GEMM table (`shiftlm calibrate`)."""

    name: str
    flops: float
    nbytes: float
    gemm: bool
    shape: tuple[float, float, float] | None = None
    role: str = "forward"
    seq: float = 0.0  # a fused attention kernel's sequence length (the calibrated rates are by length)


def backward_gemms(ops: list[Kernel], role: str) -> list[Kernel]:
    """The dgrad (dx = dy W) or wgrad (dW = dy^T x) GEMM of each forward GEMM: the same FLOPs and
    bytes, timed at that role's rate."""
    return [replace(op, role=role) for op in ops]


def serving_gemms(ops: list[Kernel], hardware: Hardware) -> list[Kernel]:
    """`ops` as a serving engine runs them: its GEMMs at the profile's measured `INFERENCE_ROLE`
    rates where the profile has them (a calibrated CPU engine runs oneDNN on packed weights, ~2x
    `F.linear`), else unchanged (a catalog GPU, or a profile from before the role existed)."""
    if not any(row[0] == INFERENCE_ROLE for row in hardware.gemm_table):
        return ops
    return [replace(op, role=INFERENCE_ROLE) if op.gemm and op.role == "forward" else op for op in ops]


@dataclass(frozen=True)
class Shard(ParallelConfig):
    """How one layer is cut on this GPU: its tp, sp and cp (ring attention: tokens split cp ways, each
    rank 1/cp of the causal work, zigzag) and Megatron sequence parallelism, as the core layout says
    them, plus the kernels' precision and attention kind."""

    sequence_parallel: bool = True
    flash_attention: bool = True
    dtype_bytes: int = 2
    expert_tp: int = 0  # the tp splitting each expert (0: tp; `ParallelConfig.expert_tp`)


def _gemm(name: str, m: float, k: float, n: float, width: int) -> Kernel:
    return Kernel(name, 2 * m * k * n, width * (m * k + k * n + m * n), True, (m, k, n))


def forward_ops(
    model: ModelConfig, sequences: float, query_tokens: int, kv_tokens: int, shard: Shard
) -> list[Kernel]:
    """Kernels of one layer's forward on one GPU, for `sequences` x `query_tokens` new tokens that
    attend to `kv_tokens` positions each (training: query_tokens = kv_tokens = seq_len)."""
    width = shard.dtype_bytes
    tokens = sequences * query_tokens / (shard.sp * shard.cp)  # Ulysses and the ring split tokens
    h, tp = model.hidden_size, shard.tp
    q = model.num_heads * model.head_dim  # = h unless the config sets head_dim (Qwen3, Gemma)
    qkv = q + 2 * model.kv_dim
    # norms + the two residual/dropout adds touch 22 bytes per hidden element (Korthikanti 4.1)
    pointwise_share = tp if shard.sequence_parallel else 1
    ops = [
        Kernel("norms+residuals", 0.0, 22 * tokens * h / pointwise_share, False),
        _gemm("qkv", tokens, h, qkv / tp, width),
        _gemm("out_proj", tokens, q / tp, h, width),
        *ffn_ops(model, tokens, shard),
    ]
    heads = model.num_heads / (tp * shard.sp)  # after the all-to-all: all tokens, fewer heads
    q_all, d = sequences * query_tokens * heads / shard.cp, model.head_dim  # zigzag: 1/cp of the work
    if shard.flash_attention:
        # causal blocks above the diagonal are skipped (FlashAttention-2, Dao 2023, Sec. 3.1)
        visible = kv_tokens - query_tokens / 2
        kv_bytes = 2 * sequences * kv_tokens * heads * d * width
        ops.append(
            Kernel(
                "flash_attention",
                4 * q_all * visible * d,
                2 * q_all * d * width + kv_bytes,
                True,
                role="attention",  # timed at the GPU's flash-attention rate (Hardware.attention_flops)
                seq=kv_tokens,
            )
        )
    else:
        scores = q_all * kv_tokens
        ops += [
            Kernel("qk", 2 * scores * d, width * (2 * q_all * d + scores), True),
            Kernel("softmax+dropout", 0.0, 9 * scores, False),  # read/write scores, probs, mask
            Kernel("av", 2 * scores * d, width * (scores + 2 * q_all * d), True),
        ]
    return ops


def _grouped(name: str, groups: float, m: float, k: float, n: float, width: int) -> Kernel:
    """One grouped GEMM over `groups` experts of m rows each: the FLOPs and bytes of all of them, one
    kernel, timed at the per-expert shape (what a calibrated profile's table is looked up by)."""
    return Kernel(name, groups * 2 * m * k * n, width * groups * (m * k + k * n + m * n), True, (m, k, n))


def _scaled(op: Kernel, share: float) -> Kernel:
    return replace(op, flops=op.flops * share, nbytes=op.nbytes * share)


def ffn_ops(model: ModelConfig, tokens: float, shard: Shard) -> list[Kernel]:
    """The FFN kernels of one layer (averaged over layers where dense and MoE layers mix): the dense
    MLP, or the router, the permutes and the experts' grouped GEMMs at their real per-expert size
    (`sim/moe.py`: T*k rows over the rank's E/ep experts, balanced) and the shared expert."""
    h, tp, width = model.hidden_size, shard.tp, shard.dtype_bytes
    gate, act = (2, 6) if model.gated_mlp else (1, 4)
    f = model.intermediate_size / tp
    dense = [
        _gemm("mlp_in", tokens, h, f * gate, width),
        Kernel("activation", 0.0, act * tokens * f, False),
        _gemm("mlp_out", tokens, f, h, width),
    ]
    if not model.is_moe:
        return dense
    expert_tp = shard.expert_tp or tp
    routed = tokens * expert_tp / tp  # etp != tp: its 1/tp, gathered over etp (sim/moe.py)
    rows = routed * model.num_experts_per_tok
    local = model.num_experts / shard.ep
    fe = model.moe_intermediate_size / expert_tp
    moe = [
        _gemm("router", routed, h, model.num_experts, width),
        Kernel("permute+unpermute", 0.0, 2 * width * (routed + rows) * h, False),
        _grouped("expert_in", local, rows / local, h, fe * gate, width),
        Kernel("expert_activation", 0.0, act * rows * fe, False),
        _grouped("expert_out", local, rows / local, fe, h, width),
    ]
    if model.shared_expert_intermediate_size:
        fs = model.shared_expert_intermediate_size / tp
        moe += [
            _gemm("shared_in", tokens, h, fs * gate, width),
            Kernel("shared_activation", 0.0, act * tokens * fs, False),
            _gemm("shared_out", tokens, fs, h, width),
            _gemm("shared_gate", tokens, h, 1, width),
        ]
    share = moe_share(model)
    if share >= 1:
        return moe
    return [_scaled(op, 1 - share) for op in dense] + [_scaled(op, share) for op in moe]


# the GEMMs with weights: their backward is a dgrad (I) and a wgrad (W)
WEIGHT_GEMMS = (
    "qkv",
    "out_proj",
    "mlp_in",
    "mlp_out",
    "router",
    "expert_in",
    "expert_out",
    "shared_in",
    "shared_out",
    "shared_gate",
)


ATTENTION_ROLES = ("attention", "attention_backward")


def attention_rate(hardware: Hardware, role: str, seq: float) -> float | None:
    """A calibrated profile's causal attention FLOP/s (`shiftlm calibrate` on CUDA writes
    `attention_fwd_<seq>` / `attention_bwd_<seq>`) at the measured length nearest `seq` (log scale),
    or None where the profile has none."""
    key = "attention_fwd_" if role == "attention" else "attention_bwd_"
    rates = {float(k[len(key) :]): v for k, v in hardware.extra.items() if k.startswith(key)}
    if not rates or seq <= 0:
        return None
    return rates[min(rates, key=lambda length: abs(math.log(length / seq)))]


def kernels_time(ops: list[Kernel], hardware: Hardware, efficiency: Efficiency, dtype: str) -> float:
    """Roofline time of running `ops` back to back; a GEMM with a shape takes the measured rate of
    its shape and role where the hardware has a GEMM table, else the GPU's achievable matmul rate
    (datasheet peak x its published MAMF share, `Hardware.achievable_flops`; a flash-attention
    kernel: FlashAttention-2's published share, `Hardware.attention_flops`) times `efficiency.gemm`.
    No kernel runs faster than `Hardware.device_peak` (a fitted or calibrated efficiency cannot
    exceed the device's peak, so a predicted MFU cannot exceed 100%)."""
    device_peak = hardware.device_peak(dtype)
    peak = min(hardware.achievable_flops(dtype) * efficiency.gemm, device_peak)
    attention_peak = min(
        hardware.attention_flops(dtype) * efficiency.gemm * efficiency.attention_kernel, device_peak
    )
    bandwidth = hardware.hbm_bandwidth * efficiency.memory
    total = 0.0
    for op in ops:
        measured = hardware.gemm_rate(op.role, *op.shape) if op.gemm and op.shape is not None else None
        rate = attention_peak if op.role in ATTENTION_ROLES else peak
        if op.role in ATTENTION_ROLES:
            measured = attention_rate(hardware, op.role, op.seq)
            measured = measured and measured * efficiency.attention_kernel
        rate = rate if measured is None else min(measured * efficiency.gemm, device_peak)
        total += max(op.flops / rate, op.nbytes / bandwidth) + efficiency.kernel_overhead
    return total


def layer_comm_time(
    model: ModelConfig,
    tokens: float,
    shard: Shard,
    tp_links: tuple[int, int],
    sp_links: tuple[int, int],
    links: Links,
) -> float:
    """Communication of one layer's forward: two TP all-reduces (or the equal-volume all-gather +
    reduce-scatter pairs of Megatron SP), and Ulysses' all-to-alls of q, k, v and the output.
    `tp_links` / `sp_links` are (ranks per node, nodes) of the groups."""
    width, h = shard.dtype_bytes, model.hidden_size
    local_tokens = tokens / (shard.sp * shard.cp)
    time = 2 * all_reduce_time(local_tokens * h * width, *tp_links, links) if shard.tp > 1 else 0.0
    if shard.sp > 1:
        q = model.num_heads * model.head_dim
        qkv_bytes = local_tokens * (q + 2 * model.kv_dim) / shard.tp * width
        time += all_to_all_time(qkv_bytes, *sp_links, links)
        time += all_to_all_time(local_tokens * q / shard.tp * width, *sp_links, links)
    return time


def ring_exposed_time(
    model: ModelConfig, tokens: float, shard: Shard, attention_time: float, crosses_node: bool, links: Links
) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's ring-attention transfers *not* hidden behind the
    attention blocks (docs/context_parallel.md). Each of the cp ring steps computes 1/cp of the
    layer's attention (the zigzag split makes the blocks equal) while the next K/V block
    (2 x tokens/cp x KV heads x head_dim) travels: forward cp-1 steps, backward cp-1 K/V blocks plus
    cp fp32 dK/dV blocks, against a 2.5x heavier backward block. `attention_time`: forward
    attention of this rank for the layer."""
    from shiftlm.sim.collectives import p2p_time

    if shard.cp == 1:
        return 0.0, 0.0
    kv_heads = max(model.num_kv_heads / (shard.tp * shard.sp), 1)
    kv_bytes = 2 * tokens / shard.cp * kv_heads * model.head_dim * shard.dtype_bytes
    send_kv = p2p_time(kv_bytes, crosses_node, links)
    send_dkv = p2p_time(kv_bytes * 4 / shard.dtype_bytes, crosses_node, links)  # fp32 accumulators
    block = attention_time / shard.cp
    forward = (shard.cp - 1) * max(0.0, send_kv - block)
    backward = (shard.cp - 1) * max(0.0, send_kv + send_dkv - 2.5 * block) + max(0.0, send_dkv - 2.5 * block)
    return forward, backward


@dataclass(frozen=True)
class PassCosts:
    """Seconds per micro-batch for one layer: forward, input-gradient and weight-gradient passes."""

    forward: float
    backward_input: float
    backward_weight: float


def layer_pass_costs(
    model: ModelConfig,
    micro_batch: int,
    seq_len: int,
    shard: Shard,
    recompute: str,
    hardware: Hardware,
    efficiency: Efficiency,
    dtype: str,
    comm_forward: float,
    host_ops_forward: float = LAYER_OPS_FORWARD,
) -> PassCosts:
    """F, I and W of one layer. Backward GEMMs cost twice the forward (dgrad + wgrad, split into I
    and W as in zero-bubble PP, Qi et al. 2024); attention and pointwise backward go to I. Recompute
    replays the forward before I: all of it (`full`) or the attention core (`selective`,
    Korthikanti 2022 Sec. 5); FlashAttention already recomputes its scores, so selective is free."""
    ops = forward_ops(model, micro_batch, seq_len, seq_len, shard)
    gemms = [op for op in ops if op.gemm and op.name in WEIGHT_GEMMS]
    others = [op for op in ops if op not in gemms]
    forward = kernels_time(ops, hardware, efficiency, dtype)
    dgrad_time = kernels_time(backward_gemms(gemms, "dgrad"), hardware, efficiency, dtype)
    wgrad_time = kernels_time(backward_gemms(gemms, "wgrad"), hardware, efficiency, dtype)
    other_time = kernels_time(others, hardware, efficiency, dtype)
    attention_scale = 2.5 if shard.flash_attention else 2.0  # flash backward recomputes QK^T
    attention_ops = [op for op in others if op.gemm]
    attention_time = kernels_time(attention_ops, hardware, efficiency, dtype)
    attention_backward = attention_scale * attention_time
    if shard.flash_attention and attention_rate(hardware, "attention_backward", seq_len):
        # the profile's measured backward rate (FA-2's count: 2.5x the forward FLOPs; reads q, k, v,
        # o, do and writes dq, dk, dv: ~2x the forward's bytes)
        backward_ops = [
            replace(op, flops=2.5 * op.flops, nbytes=2 * op.nbytes, role="attention_backward")
            for op in attention_ops
        ]
        attention_backward = kernels_time(backward_ops, hardware, efficiency, dtype)
    backward_input = dgrad_time + 2 * (other_time - attention_time) + attention_backward
    backward_input += comm_forward  # the conjugate collectives of the forward ones
    if recompute == "full":
        backward_input += forward + comm_forward
    elif recompute == "op":
        # torchtitan's per-op selective checkpointing saves the attention kernel's output and every
        # other matmul of a block's forward (`_save_list`, the mm counter of
        # torchtitan/parallelisms/parallelize_llama.py); the backward replays the other matmuls and
        # every pointwise op: of wq, wk, wv, wo, w1, w3, w2 it recomputes wk, wo and w3
        backward_input += op_sac_gemm_share(model) * (forward - other_time) + other_time - attention_time
    elif recompute == "selective" and not shard.flash_attention:
        backward_input += kernels_time(
            [op for op in others if op.name in ("qk", "softmax+dropout", "av")], hardware, efficiency, dtype
        )
    # The ops the roofline does not time by bytes (bias adds, transposes, dropout masks, RNG state)
    # still cost a kernel's fixed device time each.
    unmodelled = (
        efficiency.kernel_overhead * max(0, LAYER_OPS_FORWARD - len(ops)),
        efficiency.kernel_overhead * max(0, LAYER_OPS_BACKWARD - 2 * len(gemms) - 2 * len(others)),
    )
    replay = host_ops_forward if recompute == "full" else 0
    forward_device = forward + comm_forward + unmodelled[0]
    backward_input += unmodelled[1] + (unmodelled[0] if recompute == "full" else 0)
    # The host issues kernels ahead of the device, but only partly: the streams overlap as
    # `overlapped` says (a pass takes at least the longer of the two, at most their sum).
    # (`host_ops_forward`: a GPT layer's LAYER_OPS_FORWARD, or a Megatron-Core MoE layer's count;
    # autograd's backward issues about two per forward op)
    host_forward = efficiency.host_op * host_ops_forward
    host_backward = efficiency.host_op * (LAYER_OPS_BACKWARD / LAYER_OPS_FORWARD * host_ops_forward + replay)
    backward = overlapped(backward_input + wgrad_time, host_backward, efficiency.host_overlap)
    forward_total = overlapped(forward_device, host_forward, efficiency.host_overlap)
    return PassCosts(forward_total, backward - wgrad_time, wgrad_time)


def op_sac_gemm_share(model: ModelConfig) -> float:
    """The share of a layer's forward GEMM FLOPs that per-op selective checkpointing recomputes:
    the 2nd, 4th and 6th of the block's matmuls, in the order the forward runs them (wq, wk, wv,
    wo, then w1, w3, w2 for a gated MLP, or w1, w2)."""
    h, q, kv, f = model.hidden_size, model.num_heads * model.head_dim, model.kv_dim, model.intermediate_size
    mlp = [h * f, h * f, f * h] if model.gated_mlp else [h * f, f * h]
    matmuls = [h * q, h * kv, h * kv, q * h, *mlp]
    return sum(matmuls[1::2]) / sum(matmuls)


def overlapped(device: float, host: float, p: float) -> float:
    """Time of a pass whose kernels take `device` seconds and whose host work to issue them takes
    `host`: the p-norm (device^p + host^p)^(1/p), from their sum (p = 1, no overlap) to the longer of
    the two (p -> inf, the host always ahead). An eager framework's host can run only so far ahead:
    every collective, `.item()`, allocator wait and RNG-state swap re-aligns the two streams, so
    where host ~ device neither hides the other (vTrain single-node: ~1.5x the longer at equal
    lengths, fitted p ~ 2)."""
    if host <= 0.0:
        return device
    return (device**p + host**p) ** (1.0 / p)


def head_pass_costs(
    model: ModelConfig, tokens: float, shard: Shard, hardware: Hardware, efficiency: Efficiency, dtype: str
) -> PassCosts:
    """The vocabulary-parallel LM head and fp32 cross-entropy on the last stage (per micro-batch)."""
    local = tokens / (shard.sp * shard.cp)
    logits = _gemm("lm_head", local, model.hidden_size, model.vocab_size / shard.tp, shard.dtype_bytes)
    cross_entropy = Kernel("cross_entropy", 0.0, 12 * local * model.vocab_size / shard.tp, False)
    forward = kernels_time([logits, cross_entropy], hardware, efficiency, dtype)
    dgrad = kernels_time(backward_gemms([logits], "dgrad") + [cross_entropy], hardware, efficiency, dtype)
    wgrad = kernels_time(backward_gemms([logits], "wgrad"), hardware, efficiency, dtype)
    return PassCosts(forward, dgrad, wgrad)


def optimizer_time(
    local_params: float, hardware: Hardware, efficiency: Efficiency, bytes_per_param: float = 30.0
) -> float:
    """The optimizer step, purely memory-bound: `bytes_per_param` HBM bytes per local parameter.
    Fused mixed-precision Adam reads fp32 master/m/v and the grad and writes them and the bf16 copy
    (~30 bytes); Megatron-LM's fp16 optimizer makes more passes (`Layout.optimizer_bytes`)."""
    return bytes_per_param * local_params / (hardware.hbm_bandwidth * efficiency.memory)
