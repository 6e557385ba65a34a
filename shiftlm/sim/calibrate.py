"""`shiftlm calibrate`: measure this machine into a hardware profile the simulator loads as "this".

What is measured (about 30 s on 2 cores):
- GEMM throughput of `torch.matmul` in fp32 over a few square and skinny shapes; the best rate is the
  profile's peak, so the profile is used with `efficiency.MEASURED` (all factors 1).
- Memory bandwidth from a large tensor copy (read + write).
- gloo all-reduce time by message size on 2 local ranks (`LocalWorkers`; the median of repeats, robust
  to a preempted run), fitted to the alpha-beta model `t = 2 alpha + bytes / bandwidth` that
  `collectives.all_reduce_time` uses for 2 ranks, on relative error so small messages set alpha.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

from shiftlm.sim.hardware import Hardware

GEMM_SHAPES = [(256, 256, 256), (1024, 1024, 1024), (2048, 1024, 4096), (4096, 512, 512)]
MESSAGE_BYTES = [2**k for k in range(10, 25, 2)]  # 1 KiB .. 16 MiB


def _best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_gemm(log: Callable[[str], None]) -> float:
    """Best fp32 matmul FLOP/s over GEMM_SHAPES on one thread: a rank of `shiftlm.launch` runs one
    thread, so one core is one simulated device."""
    import torch

    best, threads = 0.0, torch.get_num_threads()
    torch.set_num_threads(1)
    for m, k, n in GEMM_SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        rate = 2 * m * k * n / _best_time(lambda a=a, b=b: torch.matmul(a, b), repeats=5)
        log(f"calibrate: gemm {m}x{k}x{n} fp32: {rate / 1e9:.1f} GFLOP/s")
        best = max(best, rate)
    torch.set_num_threads(threads)
    return best


def measure_memory_bandwidth(log: Callable[[str], None]) -> float:
    """Bytes/s of a 256 MiB copy (counted as read + write)."""
    import torch

    source = torch.empty(64 * 2**20, dtype=torch.float32)
    target = torch.empty_like(source)
    seconds = _best_time(lambda: target.copy_(source), repeats=5)
    bandwidth = 2 * source.numel() * 4 / seconds
    log(f"calibrate: memory copy: {bandwidth / 1e9:.1f} GB/s")
    return bandwidth


def time_all_reduce(sizes: list[int], repeats: int = 7) -> list[float]:
    """Runs on every rank of a LocalWorkers pool: median all-reduce time per message size."""
    import torch
    import torch.distributed as dist

    times = []
    for nbytes in sizes:
        tensor = torch.zeros(nbytes // 4)
        dist.barrier()
        dist.all_reduce(tensor)  # warm up
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            dist.all_reduce(tensor)
            samples.append(time.perf_counter() - start)
        times.append(statistics.median(samples))
    return times


def fit_alpha_beta(sizes: list[int], times: list[float]) -> tuple[float, float]:
    """Fit t = a + bytes * b minimising squared *relative* error, so the 1 KiB point weighs as much
    as the 16 MiB one (plain least squares lets the largest message decide and drives a to 0 on a
    loaded machine). Weighted normal equations with weights 1/t^2; returns (per-step latency a/2 of
    the 2-rank all-reduce, bandwidth 1/b). A negative intercept is clipped and b refitted through 0."""
    weights = [1 / t**2 for t in times]
    sw = sum(weights)
    sx = sum(w * x for w, x in zip(weights, sizes))
    sy = sum(w * y for w, y in zip(weights, times))
    sxx = sum(w * x * x for w, x in zip(weights, sizes))
    sxy = sum(w * x * y for w, x, y in zip(weights, sizes, times))
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    intercept = (sy - slope * sx) / sw
    if intercept < 0:
        intercept, slope = 0.0, sxy / sxx
    return intercept / 2, 1 / slope


def measure_collectives(log: Callable[[str], None]) -> tuple[float, float]:
    from shiftlm.launch import LocalWorkers

    with LocalWorkers(2) as workers:
        times = max(workers.run(time_all_reduce, MESSAGE_BYTES), key=sum)
    for nbytes, seconds in zip(MESSAGE_BYTES, times):
        log(f"calibrate: gloo all-reduce 2 ranks {nbytes / 1024:8.0f} KiB: {seconds * 1e6:9.1f} us")
    latency, bandwidth = fit_alpha_beta(MESSAGE_BYTES, times)
    log(
        f"calibrate: alpha-beta fit: latency {latency * 1e6:.1f} us per step, bandwidth {bandwidth / 1e9:.2f} GB/s"
    )
    return latency, bandwidth


def calibrate(log: Callable[[str], None] = print) -> Hardware:
    """Measure this machine; ranks are local processes, so intra- and inter-node links are the same."""
    gemm = measure_gemm(log)
    memory_bandwidth = measure_memory_bandwidth(log)
    latency, bandwidth = measure_collectives(log)
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
        notes=f"measured by shiftlm calibrate on {cores} cores",
    )
