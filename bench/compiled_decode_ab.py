"""The compiled decode step (serve/worker/compiled_step.py) vs the eager step, in one process.

    python bench/compiled_decode_ab.py                                   # default cases
    python bench/compiled_decode_ab.py --cases 1,160 32,160 --rounds 6

Each case is `sequences,context` (a pure decode step: one new token per sequence). The model is
bench/vs_vllm.py's random-weight Llama (hidden 512, 4 layers, 8/2 heads, fp32), one thread. Two runners
on the same weights, one eager and one compiled, time `runner.execute` of the same plan alternately
(the order flips every round) as the minimum thread CPU time of `--reps` steps per round; the result is
the minimum over rounds. The compiled runner compiles at load (`CompiledDecode.warm_up`, logged);
batches above the compiled step's `max_seqs` run eager in both (a check that nothing else changed). Writes
bench/results/compiled_decode_ab.json and .png (compiled/eager per case) with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CASES = ["1,160", "1,512", "2,160", "32,160"]


def plan_of(seqs: int, context: int):
    from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan

    blocks = context // 16 + 1
    chunks = tuple(
        ScheduledChunk(i, (5,), context, tuple(range(i * blocks, (i + 1) * blocks)), True, row=i)
        for i in range(seqs)
    )
    return StepPlan(0, Mode.TP, chunks)


def step_ms(runner, plan, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.thread_time()
        runner.execute(plan)
        best = min(best, time.thread_time() - start)
    return 1e3 * best


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(range(len(rows)), [r["ratio"] for r in rows])
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(ylabel="compiled / eager step time (lower is better)", title="decode step: compiled vs eager")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['seqs']} seqs @ {r['context']}" for r in rows], rotation=20, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES, help="sequences,context")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--checkpoint-dir", default=None, help="reuse (or write) the model here")
    parser.add_argument(
        "--gemv-rows",
        type=int,
        default=None,
        help="batches of up to this many rows run MKL's GEMV in both runners, and compiled (default: the "
        "startup probe decides; where oneDNN wins at 1 row nothing is compiled)",
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    try:
        cases = [tuple(int(v) for v in case.split(",")) for case in args.cases]
        if any(len(c) != 2 or c[0] < 1 or c[1] < 0 for c in cases):
            raise ValueError
    except ValueError:
        parser.error(f"--cases: each is sequences,context (e.g. 32,160), got {args.cases}")
    import torch

    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    sys.path.insert(0, str(ROOT / "bench"))
    from vs_vllm import make_checkpoint

    torch.set_num_threads(1)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.checkpoint_dir or Path(tmp) / "llama-h512")
        if not (model / "config.json").exists():
            make_checkpoint(model)
        blocks = max(s * (c // 16 + 1) for s, c in cases) + 16
        mesh = Mesh(ParallelConfig())
        start = time.perf_counter()
        compiled = ModelRunner.load(
            model, mesh, num_blocks=blocks, block_size=16, compile_decode=True, gemv_rows=args.gemv_rows
        )
        compile_s = time.perf_counter() - start
        runners = {
            "eager": ModelRunner.load(
                model, mesh, num_blocks=blocks, block_size=16, gemv_rows=args.gemv_rows
            ),
            "compiled": compiled,
        }
    rows = []
    for seqs, context in cases:
        plan = plan_of(seqs, context)
        for runner in runners.values():
            for _ in range(3):
                runner.execute(plan)
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for round_ in range(args.rounds):
            for name in list(runners) if round_ % 2 == 0 else list(runners)[::-1]:
                times[name].append(step_ms(runners[name], plan, args.reps))
        eager, compiled = min(times["eager"]), min(times["compiled"])
        rows.append(
            {
                "seqs": seqs,
                "context": context,
                "eager_ms": eager,
                "compiled_ms": compiled,
                "ratio": compiled / eager,
                "rounds": times,
            }
        )
        print(
            f"{seqs:3d} seqs @ {context:5d}: eager {eager:7.2f} ms  compiled {compiled:7.2f} ms  "
            f"ratio {compiled / eager:.3f}",
            flush=True,
        )
    result = {
        "cases": rows,
        "load_with_compile_s": compile_s,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compiled_decode_ab.json").write_text(json.dumps(result, indent=1))
    plot(rows, out / "compiled_decode_ab.png")
    print(f"compiled runner's load (compiles included): {compile_s:.1f} s")
    print(
        f"load average before {load_before}, after {result['loadavg_after']}; wrote {out}/compiled_decode_ab.json"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
