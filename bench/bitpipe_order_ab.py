"""BitPipe's two greedy orders (plain, and latency-aware: `greedy_order(..., latency=0.5)`) and our 1F1B,
timed A/B/C in one run on 2 gloo ranks with the model of bench/vs_torch_pipelining.py.

    python bench/bitpipe_order_ab.py --steps 40

Every step is `barrier; step; barrier`, the slowest rank counting; the sides alternate step by step
(reversed every other step), so load elsewhere hits all alike. Prints medians and minima as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from shiftlm.launch import LocalWorkers  # noqa: E402


def _schedules() -> dict:
    from shiftlm.pipeline.actions import Placement, PlacementKind, Schedule
    from shiftlm.pipeline.greedy import greedy_order
    from shiftlm.pipeline.schedules import build_schedule

    out = {"1f1b": build_schedule("1f1b", 2, 8)}
    placement = Placement(PlacementKind.BIDIRECTIONAL, 2, 2)
    for label, latency in (("bitpipe_plain", 0.0), ("bitpipe_latency_aware", 0.5)):
        ranks = greedy_order(placement, 8, [6, 6], split_backward=False, grad_sync=True, latency=latency)
        out[label] = Schedule("bitpipe", placement, 8, tuple(tuple(a) for a in ranks))
    return out


def _work(steps: int) -> dict:
    import torch.distributed as dist
    import vs_torch_pipelining as b

    from shiftlm.pipeline.executor import PipelineExecutor

    rank = dist.get_rank()
    sides = {}
    for name, schedule in _schedules().items():
        full = b._split(b._full_model(512), schedule.num_stages, b.Linear)
        copies = [full] + [copy.deepcopy(full) for _ in range(schedule.placement.replicas - 1)]
        held = {key: copies[key[1]][key[0]] for key in schedule.placement.stages_of(rank)}
        executor = PipelineExecutor(schedule, held, rank=rank, loss_fn=b._loss)
        inputs, targets = b._data(512, 64)
        executor.step(inputs, targets)  # warm-up (shape headers)
        sides[name] = (executor, inputs, targets)
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for k in range(steps):
        for name in names if k % 2 == 0 else names[::-1]:
            executor, inputs, targets = sides[name]
            dist.barrier()
            start = time.perf_counter()
            executor.step(inputs, targets)
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    with LocalWorkers(2, timeout=600) as workers:
        per_rank = workers.run(_work, args.steps)
    result = {"loadavg_at_end": os.getloadavg(), "steps": args.steps}
    for name in per_rank[0]:
        slowest = [max(a, b) for a, b in zip(per_rank[0][name], per_rank[1][name])]
        result[name] = {"median_ms": statistics.median(slowest) * 1e3, "min_ms": min(slowest) * 1e3}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
