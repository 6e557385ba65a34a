"""`shiftlm calibrate` on one device as `shiftlm train` runs a step on it (`calibrate_device`): bf16 GEMM
rates by role and shape, causal attention forward/backward rates by sequence length, copy bandwidth,
the host overhead of an eager op and of an eager and a compiled step. On CUDA for the GPU a training
rank runs on; the same code measures the CPU (its tests run it there)."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable

from shiftlm.hardware import GEMM_ROLES, Hardware
from shiftlm.sim.calibrate import STACK_DEPTH, gemm_pass, mean_time

# -- one device, as `shiftlm train` runs a step on it (CUDA; the same code measures the CPU) ------------
# per device type: the step's GEMM rows (tokens per micro-batch) and (k, n) widths (a ~1.1B Llama's
# q/o, gate/up, down and LM head on CUDA), the attention's sequence lengths and (batch, heads, head_dim)
STEP_GEMM_ROWS = {"cuda": (2048, 8192), "cpu": (128, 512)}
STEP_GEMM_WIDTHS = {
    "cuda": ((2048, 2048), (2048, 5632), (5632, 2048), (2048, 32000)),
    "cpu": ((256, 256), (256, 1024), (1024, 256)),
}
ATTENTION_SEQS = {"cuda": (512, 1024, 2048, 4096), "cpu": (64, 128, 256)}
ATTENTION_SHAPE = {"cuda": (4, 32, 64), "cpu": (1, 4, 32)}
COPY_BYTES = {"cuda": 2**30, "cpu": 2**28}
# the model whose step measures the host's share: tiny, so its kernels take no time and what a step
# costs is launches, dispatch and Python (per layer, eager against compiled blocks)
OVERHEAD_MODEL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)


def _synced_mean(fn: Callable[[], object], device, repeats: int, budget: float) -> float:
    """`mean_time` of `fn` with the device drained before and after each run (kernels are async)."""
    import torch

    def synced() -> object:
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return result

    synced()
    return mean_time(synced, repeats, budget)


def _attention_rates(device, dtype, budget: float) -> dict[int, tuple[float, float]]:
    """Causal SDPA forward and backward FLOP/s by sequence length: forward 2 GEMMs of B H S^2 D FLOPs
    each, half of them under the causal mask; backward 5 (FlashAttention-2's count: 2.5 x forward)."""
    import torch
    import torch.nn.functional as F

    batch, heads, head_dim = ATTENTION_SHAPE[device.type]
    rates = {}
    for seq in ATTENTION_SEQS[device.type]:
        q, k, v = (
            torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
            for _ in range(3)
        )
        grad = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype)

        def forward_only(q=q, k=k, v=v) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def both(q=q, k=k, v=v, grad=grad) -> None:
            torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad)

        forward = _synced_mean(forward_only, device, 10, budget)
        backward = max(_synced_mean(both, device, 10, budget) - forward, 1e-9)
        flops = 2 * 2 * batch * heads * seq * seq * head_dim / 2
        rates[seq] = (flops / forward, 2.5 * flops / backward)
    return rates


def _step_overheads(device, budget: float) -> dict[str, float]:
    """Seconds per layer of a forward + backward whose kernels take no time (`OVERHEAD_MODEL`, 1 x 8
    tokens): the host's share of a step, eager and with compiled blocks (`model/compile.py`); the
    compiled one only where inductor builds for `device`."""
    import torch

    from shiftlm.config import ModelConfig
    from shiftlm.model import build_model
    from shiftlm.model.compile import CompiledBlock, compile_blocks

    config = ModelConfig(**OVERHEAD_MODEL)
    ids = torch.randint(0, config.vocab_size, (1, 8), device=device)
    result = {}
    for name in ("eager", "compiled"):
        model = build_model(config, seed=0).to(device)
        model.mesh.device = device  # a world of one: its mesh only places the positions' index
        if name == "compiled" and not compile_blocks([model], device):
            continue

        def step(model=model) -> None:
            model(ids).float().sum().backward()  # PLAIN ops, the compiled blocks' (model/ops.py)

        step()  # the compiled blocks build here, outside the timing
        if name == "compiled" and CompiledBlock.broken is not None:
            continue  # inductor failed to build after all and the blocks ran eagerly: no compiled time
        result[f"step_overhead_{name}"] = _synced_mean(step, device, 20, budget) / config.num_layers
    return result


def _copy_bandwidth(device, budget: float) -> float:
    """Bytes/s read + written by a copy far larger than any cache."""
    import torch

    source = torch.empty(COPY_BYTES[device.type] // 4, device=device)
    target = torch.empty_like(source)
    return 2 * COPY_BYTES[device.type] / _synced_mean(lambda: target.copy_(source), device, 10, budget)


def time_device_kernels(device, dtype, budget: float = 0.5) -> dict:
    """What a training step on `device` is made of, measured in this process: GEMM FLOP/s by role and
    shape (STEP_GEMM_ROWS x STEP_GEMM_WIDTHS in `dtype`), causal attention forward / backward FLOP/s
    by sequence length, copy bandwidth (read + write), the host time of one eager op (a launch on
    CUDA) and of a layer's forward + backward, eager and compiled. `budget`: seconds per timing."""
    import torch

    kind = device.type
    layers = {
        (k, n): (
            [torch.randn(n, k, device=device, dtype=dtype) for _ in range(STACK_DEPTH)],
            [None] * STACK_DEPTH,
        )
        for k, n in STEP_GEMM_WIDTHS[kind]
    }
    gemm = {}
    for role in GEMM_ROLES:
        for m in STEP_GEMM_ROWS[kind]:
            for (k, n), stack in layers.items():
                seconds = _synced_mean(gemm_pass(role, m, *stack), device, 20, budget)
                gemm[role, m, k, n] = STACK_DEPTH * 2 * m * k * n / seconds
    del layers
    memory = _copy_bandwidth(device, budget)
    one = torch.ones(1, device=device)
    op = _synced_mean(lambda: [one.add(one) for _ in range(1000)], device, 5, budget) / 1000
    return {
        "gemm": gemm,
        "attention": _attention_rates(device, dtype, budget),
        "memory": memory,
        "op": op,
        **_step_overheads(device, budget),
    }


def _catalog_entry(device_name: str) -> Hardware | None:
    from shiftlm.hardware import CATALOG, device_peak_flops

    for hardware in CATALOG.values():
        if device_peak_flops(device_name, "bf16") == hardware.peak_flops.get("bf16") and any(
            part in device_name.lower() for part in hardware.name.split("-")[:1]
        ):
            return hardware
    return None


def device_profile(
    measured: dict, device_name: str, memory_bytes: float, devices: int, dtype: str, device_type: str = "cuda"
) -> Hardware:
    """A hardware profile ("this") from `time_device_kernels` on one device: the peak is the forward
    GEMMs' median rate, the attention fraction the longest sequence's forward rate over it; the links
    (one device measures none) are the catalog's for a known GPU, else the copy bandwidth. Extras:
    `attention_fwd_<seq>` / `attention_bwd_<seq>` FLOP/s, `op_overhead`, `step_overhead_eager` and
    `step_overhead_compiled` (seconds per layer), and for a catalog GPU the measured peak and copy
    bandwidth over the catalog's achievable matmul rate and HBM bandwidth (`catalog_*_ratio`).
    `device_type` ("cuda", "cpu") decides the mode `simulate train` runs by default, as the trainer's."""
    table = tuple((role, m, k, n, rate) for (role, m, k, n), rate in measured["gemm"].items())
    peak = statistics.median(rate for role, m, k, n, rate in table if role == "forward")
    attention = measured["attention"]
    longest = max(attention)
    extra = {"op_overhead": measured["op"]}
    extra |= {k: v for k, v in measured.items() if k.startswith("step_overhead_")}
    for seq, (forward, backward) in sorted(attention.items()):
        extra[f"attention_fwd_{seq}"], extra[f"attention_bwd_{seq}"] = forward, backward
    catalog = _catalog_entry(device_name)
    if catalog is not None:
        extra["catalog_gemm_ratio"] = peak / catalog.achievable_flops(dtype)
        extra["catalog_hbm_ratio"] = measured["memory"] / catalog.hbm_bandwidth
    links = catalog or None
    return Hardware(
        name="this",
        peak_flops={
            dtype: peak,
            "fp16" if dtype == "bf16" else dtype: peak,
            "fp32": peak if dtype == "fp32" else peak / 2,
        },
        hbm_bytes=memory_bytes,
        hbm_bandwidth=measured["memory"],
        intra_node_bandwidth=links.intra_node_bandwidth if links else measured["memory"],
        inter_node_bandwidth=links.inter_node_bandwidth if links else measured["memory"],
        gpus_per_node=devices,
        notes=f"measured by shiftlm calibrate on one {device_name} ({dtype}); links "
        + (f"from the catalog's {catalog.name}" if catalog else "not measured (one device)"),
        extra=extra,
        gemm_table=table,
        attention_fraction=attention[longest][0] / peak,
        device_type=device_type,
    )


def calibrate_device(device, log: Callable[[str], None] = print, budget: float = 0.5) -> Hardware:
    """`shiftlm calibrate` on one device as training uses it: bf16 on CUDA (fp32 on the CPU)."""
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    label = "bf16" if device.type == "cuda" else "fp32"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        memory_bytes, devices = (
            torch.cuda.get_device_properties(device).total_memory,
            torch.cuda.device_count(),
        )
    else:
        name = "cpu"
        memory_bytes, devices = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), 1
    measured = time_device_kernels(device, dtype, budget)
    hardware = device_profile(measured, name, memory_bytes, devices, label, device.type)
    for role, m, k, n, rate in hardware.gemm_table:
        log(f"calibrate: gemm {role:7s} {m}x{k}x{n} {label} on {name}: {rate / 1e12:.2f} TFLOP/s")
    for seq, (forward, backward) in sorted(measured["attention"].items()):
        log(
            f"calibrate: causal attention at {seq} tokens: forward {forward / 1e12:.2f}, backward {backward / 1e12:.2f} TFLOP/s"
        )
    log(
        f"calibrate: copy bandwidth {measured['memory'] / 1e9:.1f} GB/s; eager op {measured['op'] * 1e6:.1f} us"
    )
    for mode in ("eager", "compiled"):
        if f"step_overhead_{mode}" in measured:
            log(
                f"calibrate: host time per layer of a {mode} forward + backward: {measured[f'step_overhead_{mode}'] * 1e6:.0f} us"
            )
    for key in ("catalog_gemm_ratio", "catalog_hbm_ratio"):
        if key in hardware.extra:
            log(f"calibrate: {key} (measured over the catalog's): {hardware.extra[key]:.3f}")
    return hardware
