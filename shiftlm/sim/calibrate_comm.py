"""`shiftlm calibrate`'s communication probes (calibrate.py runs them on its 2 local ranks): gloo's
all-reduce, the pipeline executor's point-to-point and hand-off (through shared memory between
local ranks where the executor would use it, `comm/shm_p2p.py`), the serving runner's
shared-memory all-reduce (`comm/shm.py`), and the alpha-beta fit they are reduced to."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

HANDOFF_BYTES, HANDOFF_SAMPLES = 512 * 1024, 60  # a 128 x 1024 fp32 activation
MESSAGE_BYTES = [2**k for k in range(10, 25, 2)]  # 1 KiB .. 16 MiB
SHM_BYTES = [2**k for k in range(8, 21, 2)]  # 256 B .. 1 MiB: a serving step's sums and all-to-alls


def _median_seconds(fn: Callable[[], object], repeats: int, warmup: int) -> float:
    """Median wall time of `repeats` calls of `fn` after `warmup` untimed ones (robust to a preempted
    call, as a communication probe on a shared machine needs)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def time_all_reduce(sizes: list[int], repeats: int = 7) -> list[float]:
    """Runs on every rank of a LocalWorkers pool: median all-reduce time per message size."""
    import torch
    import torch.distributed as dist

    times = []
    for nbytes in sizes:
        tensor = torch.zeros(nbytes // 4)
        dist.barrier()
        times.append(_median_seconds(lambda t=tensor: dist.all_reduce(t), repeats, warmup=1))
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
    from shiftlm.kernels import cpu as cpu_kernels

    ranks = tuple(range(dist.get_world_size()))
    channel = shm.enable(CommGroup("calibrate", ranks, dist.group.WORLD, dist.get_rank()), cpu_kernels.load())
    if channel is None:
        return None
    times = []
    try:
        for nbytes in sizes:
            tensor = torch.zeros(nbytes // 4)
            times.append(_median_seconds(lambda t=tensor: channel.all_reduce_(t), repeats, warmup=5))
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


def fit_and_log(
    name: str, times: list[float], steps: int, log: Callable[[str], None], transport: str = "gloo"
) -> tuple[float, float]:
    for nbytes, seconds in zip(MESSAGE_BYTES, times):
        log(f"calibrate: {transport} {name} 2 ranks {nbytes / 1024:8.0f} KiB: {seconds * 1e6:9.1f} us")
    latency, bandwidth = fit_alpha_beta(MESSAGE_BYTES, times, steps)
    log(
        f"calibrate: {name} fit: latency {latency * 1e6:.1f} us per step, bandwidth {bandwidth / 1e9:.2f} GB/s"
    )
    return latency, bandwidth
