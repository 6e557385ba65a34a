"""shiftlm's pipeline executor vs `torch.distributed.pipelining`, schedule by schedule, on 2 gloo ranks.

    python bench/vs_torch_pipelining.py              # ~5 minutes on 2 busy CPU cores
    python bench/vs_torch_pipelining.py --quick      # a small model: checks that the bench runs

One fixed MLP (LAYERS Linear+tanh layers, seeded) is split into each schedule's stages, so both sides
run the same function with the same weights on the same 8 micro-batches; each side's loss and
parameter gradients after one step are compared (they must agree to fp32 rounding). Pairs (ours vs
PyTorch's class): every schedule both have, plus BitPipe against DualPipeV (both: two chunks per rank,
traffic both ways) and our DualPipeV against PyTorch's. Both sides get the same loss function and no
gradient scaling pass (PyTorch `scale_grads=False`, the loss divided by m on both).

Transports: our executor sends its messages through shared memory between local ranks
(`comm/shm_p2p.py`, its default for CPU ranks on one host); PyTorch's goes through gloo, its only CPU
backend. So that the executor and the transport can be told apart, a third side runs our executor
with gloo's point-to-point (`shm_p2p=False`), and the table shows both ratios.

Timing: a step is `barrier; step; barrier`, timed on every rank, the slowest rank counting. Each
round runs, for every pair, the three sides' steps in turn (the order rotating step by step), so a
burst of load elsewhere on a shared machine hits every side alike; the ratio of a pair is PyTorch's
median step time over ours, over every round. Writes bench/results/vs_torch_pipelining.{json,png}.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from shiftlm.launch import LocalWorkers
from shiftlm.model.deferred import Linear
from shiftlm.pipeline.executor import PipelineExecutor
from shiftlm.pipeline.schedules import build_schedule

PP, MICROBATCHES, LAYERS = 2, 8, 8
# ours (name, chunks) -> PyTorch's schedule class name and its stages per rank
PAIRS = {
    "gpipe": ("gpipe", None, "ScheduleGPipe", 1),
    "1f1b": ("1f1b", None, "Schedule1F1B", 1),
    "interleaved_1f1b": ("interleaved_1f1b", 2, "ScheduleInterleaved1F1B", 2),
    "zb_h1": ("zb_h1", None, "ScheduleInterleavedZeroBubble", 1),
    "zb_v": ("zb_v", None, "ScheduleZBVZeroBubble", 2),
    "bitpipe": ("bitpipe", None, "ScheduleDualPipeV", 2),
    "dualpipe_v": ("dualpipe_v", None, "ScheduleDualPipeV", 2),
}
RESULTS = Path(__file__).parent / "results"


def _mlp(layers: int, width: int, linear: type) -> torch.nn.Sequential:
    return torch.nn.Sequential(*[m for _ in range(layers) for m in (linear(width, width), torch.nn.Tanh())])


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target) / MICROBATCHES


def _full_model(width: int) -> torch.nn.Sequential:
    """The one model every pair splits: seeded, so every rank and every schedule has the same weights."""
    torch.manual_seed(0)
    return _mlp(LAYERS, width, Linear)


def _split(model: torch.nn.Sequential, stages: int, linear: type) -> list[torch.nn.Sequential]:
    """`stages` consecutive slices of `model`, rebuilt with `linear` layers holding copies of its weights."""
    per = LAYERS // stages
    chunks = []
    for s in range(stages):
        chunk = _mlp(per, model[0].in_features, linear)
        source = list(model)[2 * per * s : 2 * per * (s + 1)]
        for mine, theirs in zip(chunk, source):
            mine.load_state_dict({k: v.clone() for k, v in theirs.state_dict().items()})
        chunks.append(chunk)
    return chunks


def _data(width: int, rows: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(rows, width, generator=generator) for _ in range(MICROBATCHES)]
    targets = [torch.randn(rows, width, generator=generator) for _ in range(MICROBATCHES)]
    return inputs, targets


class _Ours:
    def __init__(self, name: str, chunks: int | None, width: int, rows: int, shm_p2p: bool | None = None):
        import torch.distributed as dist

        rank = dist.get_rank()
        self.schedule = build_schedule(name, PP, MICROBATCHES, chunks)
        full = _split(_full_model(width), self.schedule.num_stages, Linear)
        replicas = self.schedule.placement.replicas
        copies = [full] + [copy.deepcopy(full) for _ in range(replicas - 1)]
        self.held = {key: copies[key[1]][key[0]] for key in self.schedule.placement.stages_of(rank)}
        self.inputs, self.targets = _data(width, rows)
        self.executor = PipelineExecutor(self.schedule, self.held, rank=rank, loss_fn=_loss, shm_p2p=shm_p2p)

    def step(self) -> torch.Tensor | None:
        return self.executor.step(self.inputs, self.targets)

    def grads(self) -> dict[str, torch.Tensor]:
        """Parameter gradients by global (stage, name); replica 0's copy where there are two."""
        return {
            f"{stage}.{n}": p.grad.clone()
            for (stage, replica), module in sorted(self.held.items())
            if replica == 0 or (stage, 0) not in self.held
            for n, p in module.named_parameters()
        }


class _Torch:
    def __init__(self, class_name: str, stages_per_rank: int, width: int, rows: int):
        import torch.distributed as dist
        import torch.distributed.pipelining as pipelining
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        rank = dist.get_rank()
        num_stages = PP * stages_per_rank
        full = _split(_full_model(width), num_stages, torch.nn.Linear)
        v_shape = class_name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
        indices = [rank, 2 * PP - 1 - rank] if v_shape else [rank + k * PP for k in range(stages_per_rank)]
        self.modules = {i: full[i] for i in indices}
        stages = [pipelining.PipelineStage(full[i], i, num_stages, torch.device("cpu")) for i in indices]
        cls = getattr(pipelining, class_name)
        single = issubclass(cls, PipelineScheduleSingle)
        self.schedule = cls(stages[0] if single else stages, MICROBATCHES, loss_fn=_loss, scale_grads=False)
        inputs, targets = _data(width, rows)
        self.has_first, self.has_last = 0 in indices, num_stages - 1 in indices
        self.x, self.y = torch.cat(inputs), torch.cat(targets)

    def step(self) -> torch.Tensor | None:
        if self.has_last:
            losses: list[torch.Tensor] = []
            self.schedule.step(*([self.x] if self.has_first else []), target=self.y, losses=losses)
            return torch.stack(losses).sum()
        self.schedule.step(*([self.x] if self.has_first else []))
        return None

    def grads(self) -> dict[str, torch.Tensor]:
        return {
            f"{stage}.{n}": p.grad.clone()
            for stage, module in sorted(self.modules.items())
            for n, p in module.named_parameters()
        }


def _zero_grads(modules) -> None:
    for module in modules:
        for p in module.parameters():
            p.grad = None


def run_pair(pair: str, width: int, rows: int, steps: int, check: bool) -> dict:
    """Build both sides of `pair` on this rank; with `check`, compare one step's loss and gradients;
    then time `steps` alternating steps of each (ours first on even calls of a round, PyTorch's on odd)."""
    import torch.distributed as dist

    name, chunks, class_name, stages_per_rank = PAIRS[pair]
    ours, theirs = _Ours(name, chunks, width, rows), _Torch(class_name, stages_per_rank, width, rows)
    ours_gloo = _Ours(name, chunks, width, rows, shm_p2p=False)
    result: dict = {}
    if check:
        _zero_grads(ours.held.values()), _zero_grads(theirs.modules.values())
        loss_ours, loss_theirs = ours.step(), theirs.step()
        mine, other = ours.grads(), theirs.grads()
        # both number stages as the split does; BitPipe holds 4 of them per rank (2 per replica, each
        # copy with the summed gradient), the others 1 or 2: compare every stage PyTorch holds here
        assert other.keys() <= mine.keys(), (sorted(mine), sorted(other))
        result["grad_max_abs_diff"] = max((mine[k] - other[k]).abs().max().item() for k in other)
        result["grad_max_abs"] = max(g.abs().max().item() for g in other.values())
        # the last stage's rank reports each side's loss (BitPipe: one last stage per replica, two ranks)
        result["loss_ours"] = 0.0 if loss_ours is None else float(loss_ours.detach())
        result["loss_torch"] = 0.0 if loss_theirs is None else float(loss_theirs.detach())
    else:
        ours.step(), theirs.step()  # warm-up: PyTorch infers shapes and builds buffers on its first step
    ours_gloo.step()
    timings: dict[str, list[float]] = {"ours": [], "ours_gloo": [], "torch": []}
    sides = [("ours", ours), ("torch", theirs), ("ours_gloo", ours_gloo)]
    for k in range(steps):
        for label, side in sides[k % 3 :] + sides[: k % 3]:
            dist.barrier()
            start = time.perf_counter()
            side.step()
            dist.barrier()
            timings[label].append(time.perf_counter() - start)
    result["timings"] = timings
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model and few rounds")
    parser.add_argument("--rounds", type=int, default=None, help="passes over all pairs (default 4)")
    parser.add_argument(
        "--pairs", default=",".join(PAIRS), help="comma-separated subset of: " + ",".join(PAIRS)
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    width, rows, steps, rounds = (256, 32, 4, 1) if args.quick else (512, 64, 4, 4)
    rounds = args.rounds or rounds
    pairs = [p.strip() for p in args.pairs.split(",") if p.strip()]
    unknown = [p for p in pairs if p not in PAIRS]
    if unknown:
        raise SystemExit(f"unknown pair(s) {unknown}; choose from {', '.join(PAIRS)}")
    times: dict[str, dict[str, list[float]]] = {p: {"ours": [], "ours_gloo": [], "torch": []} for p in pairs}
    checks: dict[str, dict] = {}
    with LocalWorkers(PP, timeout=600) as workers:
        for round_index in range(rounds):
            for pair in pairs:
                per_rank = workers.run(run_pair, pair, width, rows, steps, round_index == 0)
                print(f"round {round_index + 1}/{rounds} {pair} done", file=sys.stderr, flush=True)
                if round_index == 0:
                    checks[pair] = _merge_checks(per_rank)
                for side in ("ours", "ours_gloo", "torch"):  # the slowest rank of each step
                    times[pair][side] += [max(ts) for ts in zip(*(r["timings"][side] for r in per_rank))]
    rows_out = []
    for pair in pairs:
        ours_s, torch_s = statistics.median(times[pair]["ours"]), statistics.median(times[pair]["torch"])
        gloo_s = statistics.median(times[pair]["ours_gloo"])
        name, chunks, class_name, _ = PAIRS[pair]
        rows_out.append(
            {
                "pair": pair,
                "ours": name,
                "torch": class_name,
                "ours_median_s": ours_s,
                "torch_median_s": torch_s,
                "ours_min_s": min(times[pair]["ours"]),
                "torch_min_s": min(times[pair]["torch"]),
                "speedup": torch_s / ours_s,
                "ours_gloo_median_s": gloo_s,
                "speedup_ours_over_gloo": torch_s / gloo_s,
                "samples": len(times[pair]["ours"]),
                **checks[pair],
            }
        )
    geomean = math.exp(statistics.mean(math.log(r["speedup"]) for r in rows_out))
    geomean_gloo = math.exp(statistics.mean(math.log(r["speedup_ours_over_gloo"]) for r in rows_out))
    conditions = {
        "pp": PP,
        "microbatches": MICROBATCHES,
        "layers": LAYERS,
        "width": width,
        "rows_per_microbatch": rows,
        "rounds": rounds,
        "steps_per_side_per_round": steps,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "loadavg_at_end": os.getloadavg(),
        "machine": platform.processor() or platform.machine(),
        "note": "2 gloo ranks, 1 thread each, on a machine shared with other jobs: ratios, not absolute times",
        "transports": "ours: shared-memory p2p (comm/shm_p2p.py); ours_gloo: our executor on gloo; torch: gloo",
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {
        "conditions": conditions,
        "pairs": rows_out,
        "geomean_speedup": geomean,
        "geomean_speedup_ours_over_gloo": geomean_gloo,
    }
    out = RESULTS / ("vs_torch_pipelining_quick.json" if args.quick else "vs_torch_pipelining.json")
    out.write_text(json.dumps(payload, indent=2))
    if not args.quick:
        _plot(rows_out, geomean, geomean_gloo, RESULTS / "vs_torch_pipelining.png")
    if args.json:
        print(json.dumps(payload, indent=2))
        return
    print(
        f"\n{'ours':17s} {'torch.distributed.pipelining':30s} {'ours ms':>8s} {'torch ms':>9s} {'speedup':>8s}"
        f" {'ours/gloo ms':>13s} {'speedup':>8s} {'grad diff':>10s}"
    )
    for r in rows_out:
        print(
            f"{r['ours']:17s} {r['torch']:30s} {r['ours_median_s'] * 1e3:8.1f} {r['torch_median_s'] * 1e3:9.1f} "
            f"{r['speedup']:7.2f}x {r['ours_gloo_median_s'] * 1e3:13.1f} {r['speedup_ours_over_gloo']:7.2f}x"
            f" {r['grad_max_abs_diff']:10.1e}"
        )
    print(
        f"geomean speedup {geomean:.2f}x (ours on gloo: {geomean_gloo:.2f}x)"
        f"  (load average at the end: {conditions['loadavg_at_end'][0]:.1f})"
    )


def _merge_checks(per_rank: list[dict]) -> dict:
    """One pair's correctness over both ranks: worst gradient difference, and the loss of each side."""
    merged = {
        "grad_max_abs_diff": max(r["grad_max_abs_diff"] for r in per_rank),
        "grad_max_abs": max(r["grad_max_abs"] for r in per_rank),
    }
    merged["loss_ours"] = sum(r["loss_ours"] for r in per_rank)
    merged["loss_torch"] = sum(r["loss_torch"] for r in per_rank)
    rel = abs(merged["loss_ours"] - merged["loss_torch"]) / abs(merged["loss_torch"])
    if rel > 1e-5 or merged["grad_max_abs_diff"] > 1e-5 * max(merged["grad_max_abs"], 1.0):
        raise RuntimeError(f"the two executors disagree: {merged}")
    return merged


def _plot(rows: list[dict], geomean: float, geomean_gloo: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    names = [f"{r['ours']}\nvs {r['torch'].removeprefix('Schedule')}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["speedup"] for r in rows], 0.4, color="tab:blue", label="ours (shm p2p)")
    ax.bar(
        [i + 0.2 for i in x],
        [r["speedup_ours_over_gloo"] for r in rows],
        0.4,
        color="tab:gray",
        label="ours on gloo",
    )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(geomean, color="tab:blue", linestyle="--", label=f"geomean {geomean:.2f}x")
    ax.axhline(geomean_gloo, color="tab:gray", linestyle=":", label=f"geomean on gloo {geomean_gloo:.2f}x")
    ax.set_xticks(range(len(rows)), names, fontsize=8)
    ax.set_ylabel("PyTorch step time / shiftlm step time")
    ax.set_title(f"pp={PP}, m={MICROBATCHES}, {LAYERS}-layer MLP, 2 CPU ranks; PyTorch on gloo")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
