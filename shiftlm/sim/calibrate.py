"""`shiftlm calibrate`: measure this machine into a hardware profile the simulator loads as "this".

What is measured (about 30 s on 2 cores), all on 2 local gloo ranks (`LocalWorkers`, one thread
each) running *at the same time*, because that is how every multi-rank job here runs: two busy
processes share the cores' caches and memory bus, so a rank's matmul is slower than one process alone.
- GEMM throughput in fp32 as a layer stack runs it: a micro-batch (128 or 512 rows) through 4
  *distinct* weights (1024x1024, 1024x4096, 4096x1024), each used once per pass, so weights stream
  from L3 as in a real forward; best of 10 passes per shape. The *median* over shapes is the
  profile's peak, used with `efficiency.MEASURED` (all factors 1). (The earlier estimator, the best
  of repeated matmuls on one operand pair, was set by 256^3, whose operands stay in L2: ~160 GFLOP/s
  per rank, ~25% above what a 128-row micro-batch through 1024-wide layers gets.)
- Memory bandwidth per rank from a large tensor copy (read + write).
- gloo all-reduce time by message size (the median of repeats, robust to a preempted run), fitted to
  the alpha-beta model `t = 2 alpha + bytes / bandwidth` that `collectives.all_reduce_time` uses for 2
  ranks, on relative error so small messages set alpha.
- gloo send/recv by message size (ping-pong, half the round trip), fitted to `t = alpha + bytes / bw`:
  gloo's p2p is a rendezvous (data moves once the receive is posted), with its own latency, which
  `extra["p2p_latency"]`, `extra["p2p_bandwidth"]` carry for pipeline sends.
- The fixed CPU cost of one eager op (dispatch, a 1-element add): `extra["op_overhead"]`, the
  per-kernel overhead of this machine.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

from shiftlm.sim.hardware import Hardware

GEMM_SHAPES = [(rows, k, n) for rows in (128, 512) for k, n in ((1024, 1024), (1024, 4096), (4096, 1024))]
STACK_DEPTH = 4  # distinct weights per timed pass
MESSAGE_BYTES = [2**k for k in range(10, 25, 2)]  # 1 KiB .. 16 MiB


def _best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def time_compute() -> dict[str, object]:
    """Runs on every rank of a LocalWorkers pool at once: GEMM FLOP/s per shape, copy bytes/s and
    seconds per eager op on this rank (each measured after a barrier, so both ranks compute together)."""
    import torch
    import torch.distributed as dist

    gemm = []
    for m, k, n in GEMM_SHAPES:
        x, weights = torch.randn(m, k), [torch.randn(k, n) for _ in range(STACK_DEPTH)]
        dist.barrier()
        seconds = _best_time(lambda x=x, weights=weights: [x @ w for w in weights], repeats=10)
        gemm.append(STACK_DEPTH * 2 * m * k * n / seconds)
    source = torch.empty(64 * 2**20, dtype=torch.float32)  # 256 MiB, far beyond any cache
    target = torch.empty_like(source)
    dist.barrier()
    memory = 2 * source.numel() * 4 / _best_time(lambda: target.copy_(source), repeats=5)
    one = torch.ones(1)
    dist.barrier()
    op = _best_time(lambda: [one.add(one) for _ in range(1000)], repeats=5) / 1000
    return {"gemm": gemm, "memory": memory, "op": op}


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


def time_send_recv(sizes: list[int], repeats: int = 7) -> list[float]:
    """Runs on 2 ranks: median one-way send time per message size, as half a ping-pong round trip."""
    import torch
    import torch.distributed as dist

    rank, times = dist.get_rank(), []
    peer = 1 - rank
    for nbytes in sizes:
        tensor = torch.zeros(nbytes // 4)

        def ping_pong(tensor: torch.Tensor = tensor) -> None:
            if rank == 0:
                dist.send(tensor, peer), dist.recv(tensor, peer)
            else:
                dist.recv(tensor, peer), dist.send(tensor, peer)

        dist.barrier()
        ping_pong()  # warm up
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            ping_pong()
            samples.append((time.perf_counter() - start) / 2)
        times.append(statistics.median(samples))
    return times


def fit_alpha_beta(sizes: list[int], times: list[float], latency_steps: int = 2) -> tuple[float, float]:
    """Fit t = a + bytes * b minimising squared *relative* error, so the 1 KiB point weighs as much
    as the 16 MiB one (plain least squares lets the largest message decide and drives a to 0 on a
    loaded machine). Weighted normal equations with weights 1/t^2; returns (per-step latency
    a / latency_steps: 2 for a 2-rank all-reduce, 1 for a send; bandwidth 1/b). A negative intercept
    is clipped and b refitted through 0."""
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
    return intercept / latency_steps, 1 / slope


def _fit_and_log(
    name: str, times: list[float], steps: int, log: Callable[[str], None]
) -> tuple[float, float]:
    for nbytes, seconds in zip(MESSAGE_BYTES, times):
        log(f"calibrate: gloo {name} 2 ranks {nbytes / 1024:8.0f} KiB: {seconds * 1e6:9.1f} us")
    latency, bandwidth = fit_alpha_beta(MESSAGE_BYTES, times, steps)
    log(
        f"calibrate: {name} fit: latency {latency * 1e6:.1f} us per step, bandwidth {bandwidth / 1e9:.2f} GB/s"
    )
    return latency, bandwidth


def calibrate(log: Callable[[str], None] = print) -> Hardware:
    """Measure this machine; ranks are local processes, so intra- and inter-node links are the same.
    Per-rank rates are the mean over the 2 concurrent ranks; a collective's time is its slowest rank's."""
    from shiftlm.launch import LocalWorkers

    with LocalWorkers(2) as workers:
        compute = workers.run(time_compute)
        all_reduce = max(workers.run(time_all_reduce, MESSAGE_BYTES), key=sum)
        send = max(workers.run(time_send_recv, MESSAGE_BYTES), key=sum)
    gemm = statistics.median(statistics.fmean(r["gemm"][i] for r in compute) for i in range(len(GEMM_SHAPES)))
    for index, (m, k, n) in enumerate(GEMM_SHAPES):
        rate = statistics.fmean(r["gemm"][index] for r in compute)
        log(f"calibrate: gemm {m}x{k}x{n} fp32, 2 ranks at once: {rate / 1e9:.1f} GFLOP/s per rank")
    log(f"calibrate: gemm median over shapes (the profile's peak): {gemm / 1e9:.1f} GFLOP/s")
    memory_bandwidth = statistics.fmean(r["memory"] for r in compute)
    op_overhead = statistics.fmean(r["op"] for r in compute)
    log(f"calibrate: memory copy, 2 ranks at once: {memory_bandwidth / 1e9:.1f} GB/s per rank")
    log(f"calibrate: eager op overhead: {op_overhead * 1e6:.1f} us")
    latency, bandwidth = _fit_and_log("all-reduce", all_reduce, 2, log)
    p2p_latency, p2p_bandwidth = _fit_and_log("send/recv", send, 1, log)
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
        extra={"p2p_latency": p2p_latency, "p2p_bandwidth": p2p_bandwidth, "op_overhead": op_overhead},
    )
