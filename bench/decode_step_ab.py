"""A/B of the serving engine's step time between two source trees (e.g. a commit and this checkout).

    git worktree add --detach /tmp/base 6aaf65d
    python bench/decode_step_ab.py --base /tmp/base                      # this tree is "new"
    python bench/decode_step_ab.py --base /tmp/base --cases 1,160,1 32,160,1 --rounds 6

Each case is `sequences,context,new_tokens` (new_tokens 1: a decode step; more: a chunk of that many
tokens per sequence). The model is bench/vs_vllm.py's random-weight Llama (hidden 512, 4 layers, 8/2
heads, fp32). A machine shared with other jobs makes one timing meaningless, so: every round runs one
child process per tree (`PYTHONPATH` = the tree, one thread), the order alternating between rounds;
a child times each case as the minimum thread CPU time of `--reps` steps after 3 warm-ups; the result
per tree is the minimum over rounds, with every round kept in the JSON. Writes
bench/results/decode_step_ab.json and .png (after/before per case) with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CASES = ["1,160,1", "8,160,1", "32,160,1", "64,160,1", "64,512,1", "1,160,64"]


def child(model: str, cases: list[tuple[int, int, int]], reps: int) -> dict[str, float]:
    """Runs in the tree on PYTHONPATH: min CPU ms of each case's step."""
    import torch

    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan
    from shiftlm.serve.worker.runner import ModelRunner

    torch.set_num_threads(1)
    need = max(s * ((c + t) // 16 + 1) for s, c, t in cases)
    runner = ModelRunner.load(Path(model), Mesh(ParallelConfig()), num_blocks=need + 16, block_size=16)
    out = {}
    for seqs, context, tokens in cases:
        blocks = (context + tokens) // 16 + 1
        chunks = tuple(
            ScheduledChunk(i, (5,) * tokens, context, tuple(range(i * blocks, (i + 1) * blocks)), True, row=i)
            for i in range(seqs)
        )
        plan = StepPlan(0, Mode.TP, chunks)
        for _ in range(3):
            runner.execute(plan)
        best = float("inf")
        for _ in range(reps):
            start = time.thread_time()
            runner.execute(plan)
            best = min(best, time.thread_time() - start)
        out[f"{seqs},{context},{tokens}"] = 1e3 * best
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['seqs']} x {r['tokens']} @ {r['context']}" for r in rows]
    ax.bar(range(len(rows)), [r["ratio"] for r in rows])
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(
        ylabel="step time new / base (lower is better)", title="decode step A/B (seqs x new tokens @ context)"
    )
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=20, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="source tree to compare against (a git worktree)")
    parser.add_argument("--new", default=str(ROOT), help="source tree under test (default: this checkout)")
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES, help="sequences,context,new_tokens")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--checkpoint-dir", default=None, help="reuse (or write) the model here")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        cases = [tuple(int(v) for v in case.split(",")) for case in args.cases]
        if any(len(c) != 3 or min(c) < 0 or c[0] < 1 or c[2] < 1 for c in cases):
            raise ValueError
    except ValueError:
        parser.error(f"--cases: each is sequences,context,new_tokens (e.g. 32,160,1), got {args.cases}")
    if args.child is not None:
        print(json.dumps(child(args.child, cases, args.reps)))
        return 0
    for tree in (args.base, args.new):
        if not (Path(tree) / "shiftlm" / "__init__.py").exists():
            parser.error(f"{tree} is not a shiftlm source tree (no shiftlm/__init__.py)")
    sys.path.insert(0, str(ROOT / "bench"))
    from vs_vllm import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.checkpoint_dir or Path(tmp) / "llama-h512")
        if not (model / "config.json").exists():
            make_checkpoint(model)
        load_before = os.getloadavg()
        trees = {"base": args.base, "new": args.new}
        runs: dict[str, list[dict]] = {"base": [], "new": []}
        for round_ in range(args.rounds):
            for name in list(trees) if round_ % 2 == 0 else list(trees)[::-1]:
                command = [sys.executable, __file__, "--base", args.base, "--child", str(model), "--reps"]
                command += [str(args.reps), "--cases", *args.cases]
                env = {**os.environ, "PYTHONPATH": trees[name]}
                done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    print(done.stderr[-2000:], file=sys.stderr)
                    raise SystemExit(f"the {name} child failed (exit {done.returncode})")
                runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    rows = []
    for key in (",".join(map(str, c)) for c in cases):
        seqs, context, tokens = map(int, key.split(","))
        base, new = (min(r[key] for r in runs[name]) for name in ("base", "new"))
        rows.append(
            {
                "seqs": seqs,
                "context": context,
                "tokens": tokens,
                "base_ms": base,
                "new_ms": new,
                "ratio": new / base,
            }
        )
        print(
            f"{seqs:3d} seqs x {tokens:3d} tokens @ {context:5d}: base {base:8.2f} ms  new {new:8.2f} ms  "
            f"new/base {new / base:.3f}"
        )
    result = {
        "base": args.base,
        "new": args.new,
        "rounds": runs,
        "cases": rows,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_step_ab.json").write_text(json.dumps(result, indent=1))
    plot(rows, out / "decode_step_ab.png")
    print(
        f"load average before {load_before}, after {result['loadavg_after']}; wrote {out}/decode_step_ab.json"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
