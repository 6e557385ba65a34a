"""`shiftlm calibrate`: measure this machine into a hardware profile the simulator loads as "this".

On a CUDA machine it measures one GPU as a training step uses it (`calibrate_device`, at the end of
this file): bf16 GEMM rates by role and shape, causal attention's forward and backward rates by
sequence length, HBM copy bandwidth, the launch cost of one eager op and the host time per layer of an
eager and of a compiled forward + backward; the catalog's entry for that GPU is checked against them
(`catalog_gemm_ratio`, `catalog_hbm_ratio`). The same code measures the CPU in tests. Without CUDA:

What is measured (about 25 s on 2 cores), all on 2 local gloo ranks (`LocalWorkers`, one thread
each) running *at the same time*, because that is how every multi-rank job here runs: two busy
processes share the cores' caches and memory bus, so a rank's matmul is slower than one process alone.
- GEMM rates in fp32 by shape and role (`Hardware.gemm_table`): GEMM_ROWS x GEMM_WIDTHS, each as a
  layer's forward, its dgrad and its wgrad, through STACK_DEPTH *distinct* weights per pass (weights
  stream from memory as in a real pass). Round-robin over the table for GEMM_ROUNDS rounds, the
  rate being total FLOPs / total time: the mean pass, since a step is a sum of passes (the best of
  10 predicted a 4-layer chunk's forward at ~8.5 ms against 9.3 ms inside a traced pipeline step).
  The forward median over PEAK_SHAPES is the profile's scalar peak; the efficiency is
  `efficiency.measured` (all factors 1, plus the eager-op cost per kernel).
- The serving engine's GEMMs (role "inference"), timed through the function the engine's step runs
  (`serve.shift_model`'s `inference_linear` under its `PackedWeights`: oneDNN on prepacked weights,
  no autograd), at INFERENCE_ROWS x GEMM_WIDTHS: the serving simulator's kernels take these rates,
  since oneDNN's packed GEMM runs ~2x faster than `F.linear` at 32-512 rows here.
- Memory bandwidth per rank from a large tensor copy (read + write).
- gloo all-reduce time by message size (the median of repeats, robust to a preempted run), fitted to
  the alpha-beta model `t = 2 alpha + bytes / bandwidth` that `collectives.all_reduce_time` uses for 2
  ranks, on relative error so small messages set alpha.
- send/recv by message size (ping-pong, half the round trip) through the pipeline executor's transport
  (`comm/shm_p2p.py`'s shared-memory rings between local ranks where they can be made, else gloo's
  rendezvous), fitted to `t = alpha + bytes / bw`: `extra["p2p_latency"]`, `extra["p2p_bandwidth"]`;
  and the process CPU time per byte at each end of a transfer, `extra["p2p_cpu_per_byte"]` (either
  transport copies through the cores that compute); `extra["p2p_shared_memory"]` is 1 for shm.
- The pipeline hand-off latency while the sender computes, `extra["handoff_latency"]` (`time_handoff`),
  which `collectives.p2p_links` gives pipeline sends.
- The fixed CPU cost of one eager op (dispatch, a 1-element add): `extra["op_overhead"]`, the
  per-kernel overhead of this machine.
- The shared-memory all-reduce (comm/shm.py, what the serving runner's CPU ranks on one host sum,
  broadcast and gather through instead of gloo) by message size, SHM_BYTES, fitted to the same
  alpha-beta model into `extra["shm_latency"]` and `extra["shm_bandwidth"]`: the serving cost model
  times the step's collectives with them (`serve_runner.serving_links`). Left out where the C++
  side does not build (the engine then uses gloo, and so does the model).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

from shiftlm.hardware import GEMM_ROLES, Hardware
from shiftlm.sim.calibrate_comm import (
    HANDOFF_BYTES,
    MESSAGE_BYTES,
    SHM_BYTES,
    fit_alpha_beta,
    fit_and_log,
    time_all_reduce,
    time_handoff,
    time_send_recv,
    time_shm_all_reduce,
)
from shiftlm.sim.costs import INFERENCE_ROLE

GEMM_ROWS = (16, 128, 512)  # tokens per GEMM: decode batches, micro-batches, prefill chunks
GEMM_WIDTHS = ((256, 256), (1024, 1024), (1024, 4096), (4096, 1024))  # (k, n) of y[m, n] = x[m, k] W^T
GEMM_SHAPES = [(rows, k, n) for rows in GEMM_ROWS for k, n in GEMM_WIDTHS]
INFERENCE_ROWS = (1, *GEMM_ROWS)  # decode steps run 1 row per sequence
INFERENCE_SHAPES = [(rows, k, n) for rows in INFERENCE_ROWS for k, n in GEMM_WIDTHS]
PEAK_SHAPES = [(rows, k, n) for rows in (128, 512) for k, n in GEMM_WIDTHS[1:]]  # the profile's peak
STACK_DEPTH = 4  # distinct weights per timed pass
GEMM_ROUNDS, GEMM_ROUND_BUDGET = 6, 0.03  # passes over the table; seconds per (role, shape) per round


def _mean_time(fn: Callable[[], object], repeats: int, budget: float | None = None) -> float:
    """Mean of `repeats` runs after a warm-up; with a `budget` (seconds), stop early once it is spent
    (at least 3 runs), so large shapes do not dominate the calibration's time. The mean, not the
    best run: a step is a sum of many such passes, and a sum is n x mean (the best of 10 was 4-8%
    faster than the same GEMMs inside a pipeline step here)."""
    fn()  # warm up
    times: list[float] = []
    while len(times) < repeats:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if budget is not None and len(times) >= 3 and sum(times) > budget:
            break
    return statistics.fmean(times)


def _gemm_pass(role: str, m: int, weights: list, biases: list) -> Callable[[], object]:
    """One pass of a layer stack's GEMM in `role` through STACK_DEPTH distinct [n, k] weights (so
    weights stream from memory as in a real pass): the forward F.linear(x, W, b), its dgrad dy @ W, or
    its wgrad dy^T @ x (what autograd runs for a Linear's input and weight gradients); or the serving
    engine's forward (`INFERENCE_ROLE`): the very function its step calls, inside the engine's own
    `PackedWeights` context and `torch.no_grad()`, so the probe follows the engine's code path."""
    import torch

    n, k = weights[0].shape
    like = dict(device=weights[0].device, dtype=weights[0].dtype)  # the weights' device and dtype
    if role == INFERENCE_ROLE:
        from shiftlm.serve.shift_model import PackedWeights, inference_linear

        x, packed = torch.randn(m, k), PackedWeights()

        def serve_pass() -> list:
            with torch.no_grad(), packed.active():
                return [inference_linear(x, w, b) for w, b in zip(weights, biases)]

        return serve_pass
    if role == "forward":
        x = torch.randn(m, k, **like)
        return lambda: [torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases)]
    grads = [torch.randn(m, n, **like) for _ in range(STACK_DEPTH)]
    if role == "dgrad":
        return lambda: [g @ w for g, w in zip(grads, weights)]
    x = torch.randn(m, k, **like)
    return lambda: [g.t() @ x for g in grads]


def time_compute() -> dict[str, object]:
    """Runs on every rank of a LocalWorkers pool at once: GEMM FLOP/s per (role, shape), copy bytes/s
    and seconds per eager op on this rank (each measured after a barrier, so both ranks compute
    together)."""
    import torch
    import torch.distributed as dist

    # round-robin: every (role, shape) gets a few passes per round, so a burst of load elsewhere
    # spreads over all shapes instead of deciding one; the rate is total FLOPs / total time (a mean)
    layers = {  # one stack of weights per width, shared by every row count and role
        (k, n): (
            [torch.randn(n, k) for _ in range(STACK_DEPTH)],
            [torch.randn(n) for _ in range(STACK_DEPTH)],
        )
        for k, n in GEMM_WIDTHS
    }
    passes = {
        (role, m, k, n): _gemm_pass(role, m, *layers[k, n]) for role in GEMM_ROLES for m, k, n in GEMM_SHAPES
    } | {
        (INFERENCE_ROLE, m, k, n): _gemm_pass(INFERENCE_ROLE, m, *layers[k, n])
        for m, k, n in INFERENCE_SHAPES
    }
    spent = dict.fromkeys(passes, 0.0)
    runs = dict.fromkeys(passes, 0)
    for run in passes.values():
        run()  # warm up
    for _ in range(GEMM_ROUNDS):
        dist.barrier()
        for key, run in passes.items():
            round_time, round_runs = 0.0, 0
            while round_runs < 2 or round_time < GEMM_ROUND_BUDGET:
                start = time.perf_counter()
                run()
                round_time += time.perf_counter() - start
                round_runs += 1
            spent[key] += round_time
            runs[key] += round_runs
    gemm = {
        (role, m, k, n): runs[role, m, k, n] * STACK_DEPTH * 2 * m * k * n / spent[role, m, k, n]
        for role, m, k, n in passes
    }
    source = torch.empty(64 * 2**20, dtype=torch.float32)  # 256 MiB, far beyond any cache
    target = torch.empty_like(source)
    dist.barrier()
    memory = 2 * source.numel() * 4 / _mean_time(lambda: target.copy_(source), repeats=5)
    one = torch.ones(1)
    dist.barrier()
    op = _mean_time(lambda: [one.add(one) for _ in range(1000)], repeats=5) / 1000
    return {"gemm": gemm, "memory": memory, "op": op}


def calibrate(log: Callable[[str], None] = print) -> Hardware:
    """Measure this machine; ranks are local processes, so intra- and inter-node links are the same.
    Per-rank rates are the mean over the 2 concurrent ranks; a collective's time is its slowest rank's.
    Where CUDA is visible, the GPU a training rank runs on instead (`calibrate_device`)."""
    import torch

    from shiftlm.launch import LocalWorkers

    if torch.cuda.is_available():
        return calibrate_device(torch.device("cuda", torch.cuda.current_device()), log)

    with LocalWorkers(2) as workers:
        compute = workers.run(time_compute)
        all_reduce = max(workers.run(time_all_reduce, MESSAGE_BYTES), key=sum)
        send_runs = workers.run(time_send_recv, MESSAGE_BYTES)
        handoffs = workers.run(time_handoff)[1]
        shm_runs = workers.run(time_shm_all_reduce, SHM_BYTES)
    send = max((r["wall"] for r in send_runs), key=sum)
    # CPU seconds per byte at one end of a transfer: the slope between the smallest and the largest
    # message of >= 1 MiB, mean over the 2 ranks (each sent and received every message)
    large = [i for i, nbytes in enumerate(MESSAGE_BYTES) if nbytes >= 2**20]
    cpu_per_byte = statistics.fmean(
        (r["cpu"][large[-1]] - r["cpu"][large[0]]) / (MESSAGE_BYTES[large[-1]] - MESSAGE_BYTES[large[0]])
        for r in send_runs
    )
    table = tuple(
        (role, m, k, n, statistics.fmean(r["gemm"][(role, m, k, n)] for r in compute))
        for role, m, k, n in compute[0]["gemm"]
    )
    for role, m, k, n, rate in table:
        log(f"calibrate: gemm {role:7s} {m}x{k}x{n} fp32, 2 ranks at once: {rate / 1e9:.1f} GFLOP/s per rank")
    gemm = statistics.median(
        rate for role, m, k, n, rate in table if role == "forward" and (m, k, n) in PEAK_SHAPES
    )
    log(
        f"calibrate: gemm forward median over {len(PEAK_SHAPES)} shapes (the profile's peak): {gemm / 1e9:.1f} GFLOP/s"
    )
    memory_bandwidth = statistics.fmean(r["memory"] for r in compute)
    op_overhead = statistics.fmean(r["op"] for r in compute)
    log(f"calibrate: memory copy, 2 ranks at once: {memory_bandwidth / 1e9:.1f} GB/s per rank")
    log(f"calibrate: eager op overhead: {op_overhead * 1e6:.1f} us")
    latency, bandwidth = fit_and_log("all-reduce", all_reduce, 2, log)
    transport = send_runs[0]["transport"]
    p2p_latency, p2p_bandwidth = fit_and_log("send/recv", send, 1, log, transport)
    log(f"calibrate: send/recv CPU per endpoint: {cpu_per_byte * 2**20 * 1e3:.2f} ms per MiB")
    handoff = statistics.fmean(handoffs)
    handoff_latency = max(handoff - HANDOFF_BYTES / p2p_bandwidth, p2p_latency)
    log(
        f"calibrate: pipeline hand-off of {HANDOFF_BYTES // 1024} KiB while the sender computes: mean "
        f"{handoff * 1e3:.2f} ms, median {statistics.median(handoffs) * 1e3:.2f} ms over {len(handoffs)}"
        f" -> latency {handoff_latency * 1e6:.0f} us"
    )
    shm_links = {}
    if all(run is not None for run in shm_runs):
        shm_times = max(shm_runs, key=sum)
        for nbytes, seconds in zip(SHM_BYTES, shm_times):
            log(
                f"calibrate: shared-memory all-reduce 2 ranks {nbytes / 1024:8.2f} KiB: {seconds * 1e6:9.1f} us"
            )
        shm_latency, shm_bandwidth = fit_alpha_beta(SHM_BYTES, shm_times, 2)
        log(
            f"calibrate: shared-memory all-reduce fit: latency {shm_latency * 1e6:.2f} us per step, "
            f"bandwidth {shm_bandwidth / 1e9:.2f} GB/s"
        )
        shm_links = {"shm_latency": shm_latency, "shm_bandwidth": shm_bandwidth}
    total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = os.cpu_count() or 1
    return Hardware(
        name="this",
        peak_flops={"fp32": gemm, "bf16": gemm, "fp16": gemm},  # CPU matmul runs these at fp32 speed or worse
        hbm_bytes=total_memory / cores,
        hbm_bandwidth=memory_bandwidth,
        intra_node_bandwidth=bandwidth,
        inter_node_bandwidth=bandwidth,
        gpus_per_node=cores,
        intra_node_latency=latency,
        inter_node_latency=latency,
        notes=f"measured by shiftlm calibrate on {cores} cores, 2 ranks at once",
        extra={
            "p2p_latency": p2p_latency,
            "p2p_bandwidth": p2p_bandwidth,
            "op_overhead": op_overhead,
            "p2p_cpu_per_byte": cpu_per_byte,
            "handoff_latency": handoff_latency,
            "p2p_shared_memory": float(transport == "shm"),
            **shm_links,
        },
        gemm_table=table,
    )


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
    """`_mean_time` of `fn` with the device drained before and after each run (kernels are async)."""
    import torch

    def synced() -> object:
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return result

    synced()
    return _mean_time(synced, repeats, budget)


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
    tokens): the host's share of a step, eager and with compiled blocks (`train/compile.py`); the
    compiled one only where inductor builds for `device`."""
    import torch

    from shiftlm.config import ModelConfig
    from shiftlm.model import build_model
    from shiftlm.model.deferred import plain_linears
    from shiftlm.train.compile import compile_blocks

    config = ModelConfig(**OVERHEAD_MODEL)
    ids = torch.randint(0, config.vocab_size, (1, 8), device=device)
    result = {}
    for name in ("eager", "compiled"):
        model = build_model(config, seed=0).to(device)
        model.mesh.device = device  # a world of one: its mesh only places the positions' index
        if name == "compiled" and not compile_blocks([model], device):
            continue

        def step(model=model) -> None:
            with plain_linears():
                model(ids).float().sum().backward()

        step()  # the compiled blocks build here, outside the timing
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
                seconds = _synced_mean(_gemm_pass(role, m, *stack), device, 20, budget)
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
    measured: dict, device_name: str, memory_bytes: float, devices: int, dtype: str
) -> Hardware:
    """A hardware profile ("this") from `time_device_kernels` on one device: the peak is the forward
    GEMMs' median rate, the attention fraction the longest sequence's forward rate over it; the links
    (one device measures none) are the catalog's for a known GPU, else the copy bandwidth. Extras:
    `attention_fwd_<seq>` / `attention_bwd_<seq>` FLOP/s, `op_overhead`, `step_overhead_eager` and
    `step_overhead_compiled` (seconds per layer), and for a catalog GPU the measured peak and copy
    bandwidth over the catalog's achievable matmul rate and HBM bandwidth (`catalog_*_ratio`)."""
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
    hardware = device_profile(measured, name, memory_bytes, devices, label)
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
