"""A training layout (how one step is cut across GPUs) and where each parallel group's ranks sit.

Rank order decides whether a group spans nodes. shiftlm uses
`rank = (((dp*PP + pp)*CP + cp)*SP + sp)*TP + tp` (innermost first: tp, sp, cp, pp, dp); Megatron-LM uses tp, dp, pp (Narayanan et al. 2021, Sec. 3.3), so
the validation replays measured runs with their own order.
"""

from __future__ import annotations

from dataclasses import dataclass

from shiftlm.config import RECOMPUTE_MODES, ModelConfig
from shiftlm.parallel import ParallelConfig

# recompute modes of other frameworks that validation replays and shiftlm's trainer does not run:
# torchtitan's per-op selective checkpointing ("op", `costs.op_sac_gemm_share`)
REPLAYED_RECOMPUTE = ("op",)
# how an ep group's tokens travel (`Layout.ep_dispatcher`): an NCCL all-to-all of every top-k row, or
# DeepEP's normal kernels (once per remote node over RDMA, then NVLink inside it; `moe.deepep_time`)
EP_DISPATCHERS = ("alltoall", "deepep")

SHIFTLM_ORDER = ("tp", "sp", "cp", "pp", "dp")
MEGATRON_ORDER = ("tp", "sp", "cp", "dp", "pp")  # Megatron-Core's default "tp-cp-ep-dp-pp"


@dataclass(frozen=True)
class Layout(ParallelConfig):
    """A training run on a cluster: the core's layout (`ParallelConfig`: dp, pp, sp, tp, cp, ep, etp,
    Megatron sequence parallelism, which the simulator prices by default) plus the batch, the schedule, the
    memory knobs and how the ranks sit on nodes."""

    sequence_parallel: bool = True  # Megatron SP: norms/dropout sharded over tp (Korthikanti 2022)
    micro_batch: int = 1
    global_batch: int = 1
    seq_len: int = 2048
    schedule: str = "1f1b"
    chunks: int = 1
    recompute: str = "selective"
    zero: int = 1
    flash_attention: bool = True  # no s x s score matrix in memory; 2021-22 Megatron had none
    overlap_grad_sync: bool = True  # DP all-reduce under the last backward; 2021-22 Megatron did not
    rank_order: tuple[str, ...] = SHIFTLM_ORDER
    # Megatron-LM 2021-22 hands activations off with blocking p2p (batch_isend_irecv, then
    # torch.cuda.synchronize()): the sender waits for its transfer; shiftlm's executor uses isend
    blocking_p2p: bool = False
    # HBM bytes per parameter that adding a micro-batch's weight gradients into the accumulated ones
    # moves outside the wgrad GEMM, for every micro-batch after the first: 0 where the GEMM
    # accumulates in place (Megatron-LM's gradient-accumulation fusion); 6 for autograd's in-place
    # fp16 `param.grad += grad` (Megatron-LM as of early 2021: read both, write one, 2 bytes each)
    grad_accumulation_bytes: float = 0.0
    # HBM bytes per local parameter of the optimizer step (`costs.optimizer_time`): 30 for a fused
    # mixed-precision Adam; Megatron-LM's fp16 optimizer makes more passes (measured.py: 52)
    optimizer_bytes: float = 30.0
    # HBM bytes per token per layer of the forward's pointwise ops that run unfused beyond the fused
    # kernels `costs.forward_ops` lists (an eager framework's casts, decomposed norms, RoPE and
    # repeat_kv copies: `eager_llama_pointwise_bytes`); twice that in the backward and once
    # more where the recompute replays the pointwise ops ("full", "op"). 0: fused kernels only
    pointwise_bytes: float = 0.0
    # HBM bytes per (unsharded) parameter that ZeRO-3's gathers and reduce-scatters copy outside the
    # collectives in each micro-batch: 0 where they gather into and scatter from flat buffers the
    # model's views point at (FSDP1's FlatParameter, shiftlm's own); PyTorch FSDP2 copies each
    # gathered parameter out and each gradient into its reduce-scatter input (measured.py: 14)
    zero3_copy_bytes: float = 0.0
    # how the ep group's tokens travel: "alltoall" (NCCL all-to-all of every top-k row) or "deepep"
    # (DeepEP's normal kernels: once per remote node over RDMA, then NVLink; `moe.deepep_dispatch_bytes`)
    ep_dispatcher: str = "alltoall"
    # the MoE layers are Megatron-Core's: the host issues the ops counted from its source
    # (`moe.megatron_core_moe_layer_ops`) in place of a GPT layer's dense MLP ops
    megatron_core_moe: bool = False

    def check_model(self, model: ModelConfig, chunks: int | None = None) -> None:
        """The trainer's own divisibility checks (`ParallelConfig.check_model`), with this run's chunks."""
        super().check_model(model, self.chunks if chunks is None else chunks)

    @property
    def gpus(self) -> int:
        return self.world_size

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def stride(self, axis: str) -> int:
        """Rank distance between neighbours of one `axis` group."""
        stride = 1
        for inner in self.rank_order:
            if inner == axis:
                return stride
            stride *= self.size(inner)
        raise ValueError(f"unknown axis {axis!r}")

    def check(self) -> None:
        """Raise ValueError naming what is inconsistent and how to fix it."""
        for axis in ("micro_batch", "chunks"):
            if self.size(axis) < 1:
                raise ValueError(f"--{axis.replace('_', '-')} must be >= 1")
        if self.global_batch % (self.dp * self.micro_batch):
            raise ValueError(
                f"global batch {self.global_batch} is not a multiple of dp x micro-batch "
                f"= {self.dp * self.micro_batch}; change --global-batch or --micro-batch"
            )
        if self.recompute not in RECOMPUTE_MODES + REPLAYED_RECOMPUTE:
            raise ValueError(f"--recompute must be one of {', '.join(RECOMPUTE_MODES)}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError("--zero must be 0, 1, 2 or 3")
        if self.ep_dispatcher not in EP_DISPATCHERS:
            raise ValueError(
                f"ep dispatcher must be one of {', '.join(EP_DISPATCHERS)}, not {self.ep_dispatcher!r}"
            )
        self.check_sequence(self.seq_len)  # also: every axis a positive integer


def group_placement(layout: Layout, axis: str, gpus_per_node: int) -> tuple[int, int]:
    """(ranks of one `axis` group per node, nodes it spans), assuming ranks fill nodes in order."""
    size, stride = layout.size(axis), layout.stride(axis)
    if size == 1:
        return 1, 1
    per_node = max(1, min(size, gpus_per_node // stride)) if stride < gpus_per_node else 1
    return per_node, size // per_node


def eager_llama_pointwise_bytes(model: ModelConfig, dtype_bytes: int = 2, repeat_kv: bool = True) -> float:
    """HBM bytes per token per layer that an eager (uncompiled) PyTorch Llama block's pointwise ops
    move in its forward beyond the fused kernels `forward_ops` lists (22 bytes per hidden unit for
    two fused norms and two residual adds, 6 per FFN unit for a fused SwiGLU). Counted op by op from
    torchtitan's block as its December 2024 benchmarks ran it (torchtitan 9dec370,
    torchtitan/models/norms.py `RMSNorm`, torchtitan/models/llama/model.py), each op reading its
    inputs and writing its output once, with `w` = `dtype_bytes` and fp32 = 4:
    - `RMSNorm` (x2): `x.float()` (w + 4), `pow(2)` (4 + 4), `mean(-1)` (4), `x * rsqrt` (4 + 4),
      `type_as` (4 + w), `* weight` (w + w): 36 bytes per hidden unit each at bf16;
    - residual adds (x2): `h = x + attn` reads two, writes one: 3w each;
    - `apply_rotary_emb` on q and k: `.float()` (w + 4), complex multiply (4 + 4), `type_as` (4 + w):
      20 bytes per q and k unit at bf16;
    - `repeat_kv` of k and v where heads > kv heads: `expand().reshape()` copies (read kv, write q);
      none with `repeat_kv=False` (shiftlm's block: SDPA's `enable_gqa` broadcasts the KV heads);
    - SwiGLU `silu(w1 x) * w3 x`: silu (w + w), mul (2w + w): 5w per FFN unit against the fused 6
      bytes (3w) of `forward_ops`.
    The SDPA output's `transpose(1, 2).contiguous()` is a view of the flash kernel's (b, s, h, d)
    output and copies nothing. torch.compile fuses all of this to about `forward_ops`' kernels."""
    w, h, f = dtype_bytes, model.hidden_size, model.intermediate_size
    q, kv = model.num_heads * model.head_dim, model.kv_dim
    norm = (w + 4) + 8 + 4 + 8 + (4 + w) + 2 * w
    eager = 2 * norm * h + 2 * 3 * w * h  # norms and residual adds
    eager += (w + 4 + 8 + 4 + w) * (q + kv)  # RoPE on q and k
    if repeat_kv and model.num_kv_heads < model.num_heads:
        eager += 2 * w * (kv + q)  # repeat_kv of keys and values
    fused = 22 * h + (6 if model.gated_mlp else 4) * f  # forward_ops' norms+residuals, activation
    gate = 5 * w if model.gated_mlp else 2 * w  # silu(w1 x) * w3 x, or one activation
    return eager + gate * f - fused
