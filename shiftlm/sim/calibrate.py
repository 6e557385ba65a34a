"""`shiftlm calibrate`: measure this machine into a hardware profile the simulator loads as "this".

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
from shiftlm.sim.costs import INFERENCE_ROLE

GEMM_ROWS = (16, 128, 512)  # tokens per GEMM: decode batches, micro-batches, prefill chunks
GEMM_WIDTHS = ((256, 256), (1024, 1024), (1024, 4096), (4096, 1024))  # (k, n) of y[m, n] = x[m, k] W^T
GEMM_SHAPES = [(rows, k, n) for rows in GEMM_ROWS for k, n in GEMM_WIDTHS]
INFERENCE_ROWS = (1, *GEMM_ROWS)  # decode steps run 1 row per sequence
INFERENCE_SHAPES = [(rows, k, n) for rows in INFERENCE_ROWS for k, n in GEMM_WIDTHS]
PEAK_SHAPES = [(rows, k, n) for rows in (128, 512) for k, n in GEMM_WIDTHS[1:]]  # the profile's peak
STACK_DEPTH = 4  # distinct weights per timed pass
GEMM_ROUNDS, GEMM_ROUND_BUDGET = 6, 0.03  # passes over the table; seconds per (role, shape) per round
HANDOFF_BYTES, HANDOFF_SAMPLES = 512 * 1024, 60  # a 128 x 1024 fp32 activation
MESSAGE_BYTES = [2**k for k in range(10, 25, 2)]  # 1 KiB .. 16 MiB
SHM_BYTES = [2**k for k in range(8, 21, 2)]  # 256 B .. 1 MiB: a serving step's sums and all-to-alls


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
    if role == INFERENCE_ROLE:
        from shiftlm.serve.shift_model import PackedWeights, inference_linear

        x, packed = torch.randn(m, k), PackedWeights()

        def serve_pass() -> list:
            with torch.no_grad(), packed.active():
                return [inference_linear(x, w, b) for w, b in zip(weights, biases)]

        return serve_pass
    if role == "forward":
        x = torch.randn(m, k)
        return lambda: [torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases)]
    grads = [torch.randn(m, n) for _ in range(STACK_DEPTH)]
    if role == "dgrad":
        return lambda: [g @ w for g, w in zip(grads, weights)]
    x = torch.randn(m, k)
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


def _pipeline_group():
    """The 2 ranks as the pipeline executor sees them: a `CommGroup` whose point-to-point goes through
    shared memory where the executor's would (`comm/shm_p2p.py`), and the transport's name."""
    import torch.distributed as dist

    from shiftlm.comm import CommGroup
    from shiftlm.pipeline.executor import shared_memory_p2p

    group = CommGroup("pp", tuple(range(dist.get_world_size())), dist.group.WORLD, dist.get_rank())
    return group, ("shm" if shared_memory_p2p(group, None, None) is not None else "gloo")


def time_shm_all_reduce(sizes: list[int], repeats: int = 50) -> list[float] | None:
    """Runs on every rank of a LocalWorkers pool: median all-reduce time per message size through a
    shared-memory channel over all ranks (comm/shm.py, as the serving runner makes one), or None
    where no channel can be made (no C++ side)."""
    import torch
    import torch.distributed as dist

    from shiftlm.comm import shm
    from shiftlm.comm.group import CommGroup
    from shiftlm.model import cpu_kernels

    ranks = tuple(range(dist.get_world_size()))
    channel = shm.enable(CommGroup("calibrate", ranks, dist.group.WORLD, dist.get_rank()), cpu_kernels.load())
    if channel is None:
        return None
    times = []
    try:
        for nbytes in sizes:
            tensor = torch.zeros(nbytes // 4)
            for _ in range(5):  # warm up
                channel.all_reduce_(tensor)
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                channel.all_reduce_(tensor)
                samples.append(time.perf_counter() - start)
            times.append(statistics.median(samples))
    finally:
        shm.disable_all()
    return times


def time_send_recv(sizes: list[int], repeats: int = 7) -> dict:
    """Runs on 2 ranks: per message size, the median one-way send time (half a ping-pong round trip)
    and the CPU time the whole process (gloo's threads included) spends per one-way message: on this
    host a transfer is copied by the cores that also compute, so it takes time from them. Through the
    transport the pipeline executor uses (shared memory between local ranks, else gloo)."""
    import torch
    import torch.distributed as dist

    from shiftlm.comm import irecv, isend

    group, transport = _pipeline_group()
    rank, wall, cpu = dist.get_rank(), [], []
    peer = 1 - rank
    for nbytes in sizes:
        tensor = torch.zeros(nbytes // 4)

        def ping_pong(tensor: torch.Tensor = tensor) -> None:
            if rank == 0:
                isend(tensor, peer, group).wait(), irecv(tensor, peer, group).wait()
            else:
                irecv(tensor, peer, group).wait(), isend(tensor, peer, group).wait()

        dist.barrier()
        ping_pong()  # warm up
        samples, cpu_start = [], time.process_time()
        for _ in range(repeats):
            start = time.perf_counter()
            ping_pong()
            samples.append((time.perf_counter() - start) / 2)
        wall.append(statistics.median(samples))
        cpu.append((time.process_time() - cpu_start) / (2 * repeats))
    return {"wall": wall, "cpu": cpu, "transport": transport}


def time_handoff(samples: int = HANDOFF_SAMPLES) -> list[float]:
    """Runs on 2 ranks: seconds from rank 0 posting a pipeline hand-off (the executor's header, then
    a HANDOFF_BYTES activation) to rank 1, which waits for it, holding it; rank 0 computes before and
    after the send, as a pipeline stage does. Returns rank 1's delays (rank 0 returns []). Over gloo
    the delay is bimodal on this host: ~0.6 ms when the sender's gloo thread gets a core at once,
    ~3-6 ms (a scheduler time slice) when it queues behind the computing thread, so the mean is taken.
    Through the executor's transport (shared memory between local ranks, else gloo)."""
    import torch
    import torch.distributed as dist

    from shiftlm.comm import irecv, isend

    group, _ = _pipeline_group()
    rank = dist.get_rank()
    x, w = torch.randn(128, 1024), torch.randn(1024, 1024)

    def compute(seconds: float) -> None:
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            x @ w

    delays = []
    for sample in range(samples):
        header, data = torch.zeros(10, dtype=torch.int64), torch.zeros(HANDOFF_BYTES // 4)
        sent = torch.zeros(1, dtype=torch.float64)
        tags = (3 * sample, 3 * sample + 1, 3 * sample + 2)
        dist.barrier()
        if rank == 0:
            compute(0.002)
            sent.fill_(time.time())
            works = [isend(header, 1, group, tag=tags[0]), isend(data, 1, group, tag=tags[1])]
            compute(0.006)
            for work in works:
                work.wait()
            isend(sent, 1, group, tag=tags[2]).wait()
        elif rank == 1:
            irecv(header, 0, group, tag=tags[0]).wait()
            irecv(data, 0, group, tag=tags[1]).wait()
            landed = time.time()
            irecv(sent, 0, group, tag=tags[2]).wait()
            delays.append(landed - float(sent))
    return delays


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
    name: str, times: list[float], steps: int, log: Callable[[str], None], transport: str = "gloo"
) -> tuple[float, float]:
    for nbytes, seconds in zip(MESSAGE_BYTES, times):
        log(f"calibrate: {transport} {name} 2 ranks {nbytes / 1024:8.0f} KiB: {seconds * 1e6:9.1f} us")
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
    latency, bandwidth = _fit_and_log("all-reduce", all_reduce, 2, log)
    transport = send_runs[0]["transport"]
    p2p_latency, p2p_bandwidth = _fit_and_log("send/recv", send, 1, log, transport)
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
