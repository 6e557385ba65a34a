"""The simulator's free parameters: how far below datasheet peak real kernels and collectives run.

These are the only numbers `shiftlm simulate validate` may fit. The defaults are first-principles
values from public measurements, used when nothing is fitted:
- `gemm`: the share of the GPU's *achievable* matmul rate (`Hardware.achievable_flops`: datasheet
  peak x the published MAMF share, 0.869 on A100, 0.803 on H100) that a training step's GEMMs reach:
  ~0.92, i.e. ~80% of A100 tensor-core peak for large fp16 GEMMs (cuBLAS, NVIDIA "Matrix
  Multiplication Background" guide; Megatron-LM 2021 reports 50-52% end to end *including* comm).
  Being relative to the measured best shape of each generation, one fitted value serves A100 and
  H100/H200/B200 alike.
- `memory`: STREAM-like kernels reach ~85% of HBM bandwidth.
- `intra_comm` / `inter_comm`: NCCL all-reduce bus bandwidth over datasheet link rate, ~0.75 on
  NVLink (nccl-tests on DGX A100: ~230 of 300 GB/s) and ~0.9 on InfiniBand.
- `kernel_overhead`: fixed seconds per kernel (launch + tail), ~5 us on a busy GPU stream.
- `host_op`: host (CPU) seconds to issue one framework op in eager PyTorch: Python, autograd
  recording, the ATen dispatcher and the CUDA launch, ~5-25 us per op (PyTorch "Accelerating PyTorch
  with CUDA Graphs", 2021: launch overheads dominate small kernels). The device runs what the host has
  queued, so a layer pass takes max(host, device) (`costs.layer_pass_costs`); it matters only where
  a layer's kernels are short (small hidden, small micro-batch, high TP).
- `host_overlap`: p of the p-norm (device^p + host^p)^(1/p) that composes a layer pass's host and
  device time (`costs.overlapped`): 1 = no overlap, large = the longer one hides the other; 8 is
  nearly the max (an asynchronous host well ahead).
- `handoff_latency`: seconds of fixed cost per pipeline hand-off (send/recv of one activation)
  besides its bytes: NCCL p2p setup plus Megatron-LM's `torch.cuda.synchronize()` after every
  `batch_isend_irecv` (megatron/p2p_communication.py), which drains the device queue; ~20 us.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# Framework ops (each at most one kernel) the host issues for one layer's forward in Megatron-LM's GPT layer (fused LayerNorm,
# fused softmax, fused bias-GeLU / bias-dropout-add): 2 norms, 4 GEMMs + 2 bias adds, ~12 view /
# transpose / contiguous ops around attention, 2 batched GEMMs, softmax, 2 dropouts with the CUDA RNG
# tracker's state swaps (~6), 2 bias-dropout-adds, 2 TP collectives and their autograd wrappers (~8).
# Autograd's backward issues about two per forward op (dgrad and wgrad per GEMM).
LAYER_OPS_FORWARD = 40
LAYER_OPS_BACKWARD = 2 * LAYER_OPS_FORWARD


@dataclass(frozen=True)
class Efficiency:
    gemm: float = 0.92
    memory: float = 0.85
    intra_comm: float = 0.75
    inter_comm: float = 0.90
    kernel_overhead: float = 5e-6
    host_op: float = 15e-6
    handoff_latency: float = 20e-6
    host_overlap: float = 8.0
    # share of FlashAttention-2's published rate (Hardware.attention_fraction) that the run's fused
    # attention kernel reaches: 1.0 for FA-2 itself; a framework's own kernel sets it per software
    # ("attention_kernel@llm-foundry": MPT's triton kernel, fitted on llm-foundry's A100 rows)
    attention_kernel: float = 1.0
    # HBM bytes per token per hidden unit per layer of a framework's activation copies beyond the
    # kernels the cost model lists (layout changes, casts); 0 where those kernels are all there is
    activation_bytes: float = 0.0

    def __post_init__(self) -> None:
        # a kernel cannot beat the datasheet: more than 1.0 would predict MFU above 100%
        for name in ("gemm", "memory", "attention_kernel"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"efficiency {name} = {value} must lie in (0, 1]: a fraction of the peak")

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


FIRST_PRINCIPLES = Efficiency()

# Output of `shiftlm simulate validate --refit` (fit.py: coordinate descent on the fit split of every
# table that has fit rows and names no framework). docs/simulator.md gives each one's physical meaning
# and the two or more tables that determine it. `gemm` is a share of the GPU's achievable matmul rate
# (0.866 x A100's 0.869 = 0.753 of its peak). Not fitted (issue 33's parsimony): `memory`,
# `kernel_overhead`, `handoff_latency` and `host_overlap` stay at their first-principles values above
# (one table or none determined them; a calibrated profile measures its own). `inter_comm` is one
# InfiniBand share for every cluster since 2026-11-28 (Selene's and vTrain's testbed's; vTrain's own
# value, 0.689, was determined by one table), and `host_op` is determined by vTrain single-node's
# small models and the Megatron-Core MoE table's host-bound TP4 EP8 row (22.6 us; 21.8 from vTrain alone).
FITTED = Efficiency(
    gemm=0.866,
    intra_comm=0.902,
    inter_comm=0.445,
    host_op=2.26e-5,
)

# The framework parameters (SOFTWARE_PARAMETERS, below) of llm-foundry, fitted on the fit rows of its
# A100 and H100 tables (two GPU generations determine each) with the shared constants fixed: MPT's
# triton attention at 0.58 of FA-2's rate, and 68.0 HBM bytes per token per hidden unit per layer of
# activation copies (docs/simulator.md, "The fitted constants").
FITTED_CLUSTER = {
    "attention_kernel@llm-foundry": 0.58,
    "activation_bytes@llm-foundry": 68.0,
}
FIT_PARAMETERS = (
    "gemm",
    "intra_comm",
    "inter_comm",
    "host_op",
)
# A framework's own parameters, fitted after the shared ones (which stay fixed) on the fit rows of
# that framework's tables only, so its tables never move the shared constants: MPT's triton attention
# kernel as a share of FlashAttention-2's rate and its activation copies, from the even rows of
# llm-foundry's A100 and H100 tables (under leave-one-table-out each generation predicts the other).
SOFTWARE_PARAMETERS = ("attention_kernel@llm-foundry", "activation_bytes@llm-foundry")

# A calibrated profile ("this") stores achieved rates, not datasheet peaks.
MEASURED = Efficiency(
    gemm=1.0,
    memory=1.0,
    intra_comm=1.0,
    inter_comm=1.0,
    kernel_overhead=0.0,
    host_op=0.0,
    handoff_latency=0.0,
)


def step_overhead_key(compiled: bool) -> str:
    """The profile's `extra` key of the host time per layer of a forward + backward in one mode
    (`shiftlm calibrate` on a device: `calibrate_device._step_overheads`)."""
    return f"step_overhead_{'compiled' if compiled else 'eager'}"


def measured(extra: dict[str, float], compiled: bool = False) -> Efficiency:
    """A calibrated profile's efficiency: its achieved rates as they are, plus its measured cost of
    one eager op (`extra["op_overhead"]`, from `shiftlm calibrate`) per kernel. Where the profile
    measured the host's time per layer of a forward + backward in the step's mode (`compiled`
    blocks or eager: `step_overhead_key`), that time spread over the layer's framework ops is
    `host_op`, composed with the device time as any host time is (`costs.overlapped`); 0 where it
    was not measured (`flags.compile_mode` decides what to simulate then)."""
    host = extra.get(step_overhead_key(compiled), 0.0)
    host_op = host / (LAYER_OPS_FORWARD + LAYER_OPS_BACKWARD)
    return Efficiency(1.0, 1.0, 1.0, 1.0, extra.get("op_overhead", 0.0), host_op=host_op, handoff_latency=0.0)
