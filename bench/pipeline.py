"""Run every pipeline schedule on 2 gloo ranks, and compare the step time with the simulator's.

    python bench/pipeline.py            # ~2 minutes on 2 CPU cores
    python bench/pipeline.py --quick    # smaller model, for a smoke run

One fixed MLP (LAYERS Linear+tanh layers) is split into the schedule's stage-chunks, so every schedule
does the same work; its linears defer their weight GEMMs, so W costs only those GEMMs. On each rank
we time F, I, W and B of one chunk and a send of one activation (best of 15; once per chunk size),
feed those costs to `simulate`, and run the real executor (best of 5 steps); all of it 3 times over,
keeping the best. Writes bench/results/pipeline.json and bench/results/pipeline.png (`--out DIR`:
DIR/pipeline.json and .png instead); prints one row
per schedule and the measured costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from shiftlm.launch import LocalWorkers
from shiftlm.model.deferred import Linear, WeightGradStore, accumulate_grad
from shiftlm.pipeline.executor import PipelineExecutor
from shiftlm.pipeline.schedules import build_schedule
from shiftlm.pipeline.simulator import ActionCosts, simulate

PP, MICROBATCHES, LAYERS = 2, 8, 8
CHUNKS = {
    "gpipe": None,
    "1f1b": None,
    "interleaved_1f1b": 2,
    "zb_h1": None,
    "zb_h2": None,
    "zb_v": None,
    "bitpipe": None,
}
RESULTS = Path(__file__).parent / "results"


def _chunk(layers: int, width: int) -> torch.nn.Module:
    """Deferrable linears, as in the transformer: W runs only the queued dA = dY^T X GEMMs."""
    return torch.nn.Sequential(*[m for _ in range(layers) for m in (Linear(width, width), torch.nn.Tanh())])


def _best_time(fn, repeats: int = 3) -> float:
    """Fastest of `repeats` runs: on a shared machine the minimum is the least disturbed estimate."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _backward_and_accumulate(out: torch.Tensor, params: list, inp: torch.Tensor, grad: torch.Tensor) -> None:
    """The executor's B: one autograd pass, then each parameter gradient added into .grad (without
    the add, B was timed ~4 ms (25%) below what it costs inside a step for a 4-layer chunk)."""
    grads = torch.autograd.grad(out, params + [inp], grad)
    for param, param_grad in zip(params, grads):
        accumulate_grad(param, param_grad)


def measure_costs(layers_per_chunk: int, width: int, rows: int) -> dict[str, float]:
    """Per-action seconds of one chunk on this rank; the send is timed as a ping-pong between ranks."""
    import torch.distributed as dist

    torch.manual_seed(0)
    module, x = _chunk(layers_per_chunk, width), torch.randn(rows, width)
    params = list(module.parameters())

    timings: dict[str, list[float]] = {"F": [], "I": [], "W": [], "B": []}

    def timed(kind: str, fn, *args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        timings[kind].append(time.perf_counter() - start)
        return result

    store = WeightGradStore()
    for _ in range(15):  # each pass timed on its own, the same way the executor runs it
        inp = x.clone().requires_grad_(True)
        out = timed("F", module, inp)
        grad = torch.ones_like(out)
        with store.deferring(0):
            timed("I", torch.autograd.grad, out, params + [inp], grad, allow_unused=True)
        timed("W", store.flush, 0)  # dA GEMMs + accumulate_grad into .grad, as in the executor
        timed("B", _backward_and_accumulate, module(inp), params, inp, grad)
    f, i, w, b = (min(timings[k]) for k in "FIWB")
    buffer, peer = torch.empty(rows, width), 1 - dist.get_rank()

    def ping_pong():
        if dist.get_rank() == 0:
            dist.send(x, peer), dist.recv(buffer, peer)
        else:
            dist.recv(buffer, peer), dist.send(x, peer)

    send = _best_time(ping_pong, 5) / 2
    return {"F": f, "I": i, "W": w, "B": b, "send": send}


def run_schedule(name: str, chunks: int | None, width: int, rows: int, repeats: int) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    schedule = build_schedule(name, PP, MICROBATCHES, chunks)
    layers_per_chunk = LAYERS // schedule.num_stages
    torch.manual_seed(0)
    full = [_chunk(layers_per_chunk, width) for _ in range(schedule.num_stages)]
    held = {key: full[key[0]] for key in schedule.placement.stages_of(rank)}
    inputs = [torch.randn(rows, width) for _ in range(MICROBATCHES)]
    targets = [torch.randn(rows, width) for _ in range(MICROBATCHES)]
    loss_fn = lambda out, target: torch.nn.functional.mse_loss(out, target) / MICROBATCHES  # noqa: E731
    executor = PipelineExecutor(schedule, held, rank=rank, loss_fn=loss_fn)

    def step():
        dist.barrier()
        executor.step(inputs, targets)
        dist.barrier()

    step()  # warm-up
    return _best_time(step, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model: checks the bench runs")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for pipeline.json / .png")
    args = parser.parse_args()
    width, rows, repeats, rounds = (256, 64, 2, 1) if args.quick else (1024, 128, 5, 3)
    rows_out = []
    schedules = {name: build_schedule(name, PP, MICROBATCHES, chunks) for name, chunks in CHUNKS.items()}
    with LocalWorkers(PP) as workers:
        # one cost measurement per chunk size, shared by every schedule that uses it, so predictions
        # differ only by the schedules (both ranks run the same chunk: average them); `rounds` passes
        # over everything, keeping each one's best, so a burst of load elsewhere hits no one schedule
        costs_by_layers: dict[int, dict[str, float]] = {}
        step_times: dict[str, float] = {}
        for _ in range(rounds):
            for layers in sorted({LAYERS // s.num_stages for s in schedules.values()}):
                per_rank = workers.run(measure_costs, layers, width, rows)
                mean = {k: statistics.mean(r[k] for r in per_rank) for k in per_rank[0]}
                best = costs_by_layers.setdefault(layers, mean)
                costs_by_layers[layers] = {k: min(best[k], mean[k]) for k in mean}
            for name, chunks in CHUNKS.items():
                slowest_rank = max(workers.run(run_schedule, name, chunks, width, rows, repeats))
                step_times[name] = min(step_times.get(name, slowest_rank), slowest_rank)
        for name, schedule in schedules.items():
            costs = costs_by_layers[LAYERS // schedule.num_stages]
            action_costs = ActionCosts(
                costs["F"], costs["I"], costs["W"], p2p=costs["send"], backward=costs["B"]
            )
            predicted = simulate(schedule, action_costs)
            measured = step_times[name]
            rows_out.append(
                {
                    "name": name,
                    "chunks": schedule.placement.chunks,
                    "measured_s": measured,
                    "predicted_s": predicted.makespan,
                    "error": predicted.makespan / measured - 1,
                    "bubble_fraction": predicted.bubble_fraction,
                    "costs_s": costs,
                }
            )
    baseline = next(r for r in rows_out if r["name"] == "1f1b")
    for row in rows_out:
        row["speedup_vs_1f1b"] = baseline["measured_s"] / row["measured_s"]
        row["predicted_speedup_vs_1f1b"] = baseline["predicted_s"] / row["predicted_s"]
    args.out.mkdir(parents=True, exist_ok=True)
    config = {"pp": PP, "microbatches": MICROBATCHES, "layers": LAYERS, "width": width, "rows": rows}
    (args.out / "pipeline.json").write_text(json.dumps({"config": config, "schedules": rows_out}, indent=2))
    _plot(rows_out, args.out / "pipeline.png")
    print(
        f"\n{'schedule':17s} {'measured ms':>12s} {'predicted ms':>13s} {'error':>7s} {'speedup':>8s} {'pred. speedup':>14s}"
    )
    for r in rows_out:
        print(
            f"{r['name']:17s} {r['measured_s'] * 1e3:12.1f} {r['predicted_s'] * 1e3:13.1f} {r['error']:+7.1%} "
            f"{r['speedup_vs_1f1b']:8.2f} {r['predicted_speedup_vs_1f1b']:14.2f}"
        )
    for layers, costs in costs_by_layers.items():
        print(f"{layers}-layer chunk: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in costs.items()))


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in rows]
    positions = range(len(rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar([p - 0.2 for p in positions], [r["measured_s"] * 1e3 for r in rows], 0.4, label="measured")
    ax.bar([p + 0.2 for p in positions], [r["predicted_s"] * 1e3 for r in rows], 0.4, label="simulated")
    ax.set_xticks(list(positions), names, rotation=20)
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"pp={PP}, m={MICROBATCHES}, 2 gloo ranks on CPU: measured vs simulated")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
