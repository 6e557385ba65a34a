"""`shiftlm calibrate`: measure this machine into a hardware profile the simulator loads as "this".

On a CUDA machine it measures one GPU as a training step uses it (`sim/calibrate_device.py`): bf16 GEMM rates by role and shape, causal attention's forward and backward rates by
sequence length, HBM copy bandwidth, the launch cost of one eager op and the host time per layer of an
eager and of a compiled forward + backward; the catalog's entry for that GPU is checked against them
(`catalog_gemm_ratio`, `catalog_hbm_ratio`). The same code measures the CPU in tests.

Without CUDA, what is measured (about 25 s on 2 cores), all on 2 local gloo ranks (`LocalWorkers`, one thread
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


def mean_time(fn: Callable[[], object], repeats: int, budget: float | None = None) -> float:
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


def gemm_pass(role: str, m: int, weights: list, biases: list) -> Callable[[], object]:
    """One pass of a layer stack's GEMM in `role` through STACK_DEPTH distinct [n, k] weights (so
    weights stream from memory as in a real pass): the forward F.linear(x, W, b), its dgrad dy @ W, or
    its wgrad dy^T @ x (what autograd runs for a Linear's input and weight gradients); or the serving
    engine's forward (`INFERENCE_ROLE`): the very function its step calls, with a `PackedWeights` of
    its own as the engine's `InferenceOps` passes it, under `torch.no_grad()`: the engine's code path."""
    import torch

    n, k = weights[0].shape
    like = dict(device=weights[0].device, dtype=weights[0].dtype)  # the weights' device and dtype
    if role == INFERENCE_ROLE:
        from shiftlm.model.inference_linear import PackedWeights, inference_linear

        x, packed = torch.randn(m, k), PackedWeights()

        def serve_pass() -> list:
            with torch.no_grad():
                return [inference_linear(x, w, b, packed) for w, b in zip(weights, biases)]

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
        (role, m, k, n): gemm_pass(role, m, *layers[k, n]) for role in GEMM_ROLES for m, k, n in GEMM_SHAPES
    } | {
        (INFERENCE_ROLE, m, k, n): gemm_pass(INFERENCE_ROLE, m, *layers[k, n]) for m, k, n in INFERENCE_SHAPES
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
    memory = 2 * source.numel() * 4 / mean_time(lambda: target.copy_(source), repeats=5)
    one = torch.ones(1)
    dist.barrier()
    op = mean_time(lambda: [one.add(one) for _ in range(1000)], repeats=5) / 1000
    return {"gemm": gemm, "memory": memory, "op": op}


def calibrate(log: Callable[[str], None] = print) -> Hardware:
    """Measure this machine; ranks are local processes, so intra- and inter-node links are the same.
    Per-rank rates are the mean over the 2 concurrent ranks; a collective's time is its slowest rank's.
    (Where CUDA is visible, `shiftlm calibrate` measures the GPU instead: `calibrate_device`.)"""
    from shiftlm.launch import LocalWorkers

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
        device_type="cpu",
    )
