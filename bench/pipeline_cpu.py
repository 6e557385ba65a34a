"""Where a pipeline step's CPU goes on 2 gloo ranks: wall time, the main thread's CPU, gloo's socket thread's CPU.

    python bench/pipeline_cpu.py                                   # 1f1b, bitpipe, dualpipe_v; 30 steps
    python bench/pipeline_cpu.py --schedules bitpipe,1f1b --loop-nice 0,19

The model, weights and micro-batches of bench/vs_torch_pipelining.py (our executor only). Every
(schedule, loop nice) variant is built once; then steps alternate over the variants (reversed every
other step), each `barrier; step; barrier`. Per step and rank it records the wall time, the CPU time
of the thread running the step (`time.thread_time`: compute, Python, the send/receive calls) and the
CPU time of gloo's `gloo_tcp_loop` threads (from /proc: they read incoming data and answer receive
notifications). CPU time moves much less than wall time with load from other jobs, so it shows where
a schedule's extra time goes when the wall clock cannot. `--loop-nice N` runs the variant with gloo's
socket threads at nice N during its steps (a diagnostic: gloo's loop thread polls epoll in a tight
loop while our thread holds the pair's lock, see docs/pipeline.md). Prints a table; writes
bench/results/pipeline_cpu.json. /proc counts CPU in clock ticks (10 ms): the socket-thread column is
a mean over all steps, so use >= 30 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from shiftlm.launch import LocalWorkers  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def _loop_threads() -> list[int]:
    """Thread ids of gloo's socket threads in this process."""
    tids = []
    for tid in os.listdir("/proc/self/task"):
        try:
            if Path(f"/proc/self/task/{tid}/comm").read_text().strip() == "gloo_tcp_loop":
                tids.append(int(tid))
        except OSError:
            continue
    return tids


def _cpu_seconds(tids: list[int]) -> float:
    """User + system CPU seconds of the given threads."""
    ticks = 0
    for tid in tids:
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _work(variants: list[tuple[str, int]], steps: int) -> dict[str, list[tuple[float, float, float]]]:
    import torch.distributed as dist
    import vs_torch_pipelining as bench

    sides = {}
    for name, nice in variants:
        _, chunks, _, _ = bench.PAIRS[name]
        ours = bench._Ours(name, chunks, 512, 64)
        ours.step()  # warm-up: shape headers, buffers
        sides[f"{name}@nice{nice}"] = (ours, nice)
    loop = _loop_threads()
    labels = list(sides)
    rows: dict[str, list[tuple[float, float, float]]] = {label: [] for label in labels}
    for k in range(steps):
        for label in labels if k % 2 == 0 else labels[::-1]:
            ours, nice = sides[label]
            for tid in loop:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            dist.barrier()
            loop_start, cpu_start, start = _cpu_seconds(loop), time.thread_time(), time.perf_counter()
            ours.step()
            wall, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
            dist.barrier()
            rows[label].append((wall, cpu, _cpu_seconds(loop) - loop_start))
    for tid in loop:
        os.setpriority(os.PRIO_PROCESS, tid, 0)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--schedules", default="1f1b,bitpipe,dualpipe_v", help="names from vs_torch_pipelining"
    )
    parser.add_argument(
        "--loop-nice", default="0", help="comma-separated nice values for gloo's socket threads"
    )
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    args = parser.parse_args()
    import vs_torch_pipelining as bench

    names = [n for n in args.schedules.split(",") if n]
    unknown = [n for n in names if n not in bench.PAIRS]
    if unknown:
        raise SystemExit(f"--schedules: unknown {unknown}; choose from {', '.join(bench.PAIRS)}")
    nices = [int(n) for n in args.loop_nice.split(",")]
    if any(n < 0 for n in nices) and os.geteuid() != 0:
        raise SystemExit("--loop-nice: a negative nice needs root; use values >= 0")
    variants = [(name, nice) for name in names for nice in nices]
    load = [os.getloadavg()[0]]
    with LocalWorkers(bench.PP, timeout=900) as workers:
        per_rank = workers.run(_work, variants, args.steps)
    load.append(os.getloadavg()[0])
    rows = []
    print(
        f"{'variant':22s} {'wall med':>9s} {'wall min':>9s} {'main CPU/rank':>14s} {'gloo loop CPU/rank':>19s}  (ms)"
    )
    for label in per_rank[0]:
        steps = list(zip(*(ranks[label] for ranks in per_rank)))  # per step: one tuple per rank
        wall = [max(rank[0] for rank in step) for step in steps]
        main_cpu = statistics.median(statistics.mean(rank[1] for rank in step) for step in steps)
        loop_cpu = statistics.mean(statistics.mean(rank[2] for rank in step) for step in steps)
        row = {
            "variant": label,
            "wall_median_ms": statistics.median(wall) * 1e3,
            "wall_min_ms": min(wall) * 1e3,
            "main_thread_cpu_ms_per_rank": main_cpu * 1e3,
            "gloo_loop_cpu_ms_per_rank": loop_cpu * 1e3,
            "steps": len(steps),
        }
        rows.append(row)
        print(
            f"{label:22s} {row['wall_median_ms']:9.1f} {row['wall_min_ms']:9.1f} "
            f"{row['main_thread_cpu_ms_per_rank']:14.1f} {row['gloo_loop_cpu_ms_per_rank']:19.1f}"
        )
    print(f"load average (1 min): {load[0]:.1f} -> {load[1]:.1f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"steps": args.steps, "load_1min": load, "cpus": os.cpu_count(), "variants": rows}
    (RESULTS / "pipeline_cpu.json").write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
