"""Step time of shiftlm's pipeline executor in two source trees, A/B, on 2 gloo ranks.

    python bench/pipeline_step_ab.py --old /tmp/old_tree --new . --pairs 1f1b,bitpipe --reps 4

Each repetition starts one child process per tree (old, new, then new, old on the next), with
PYTHONPATH set to that tree; the child runs the `ours` side of `bench/vs_torch_pipelining.py` (same
model, weights and micro-batches) for every pair: one warm-up step, then `--steps` timed steps
(`barrier; step; barrier`, the slower rank counting). Alternating trees spreads a burst of load from
other jobs over both. Prints the median step per tree and pair and old/new; writes
bench/results/pipeline_step_ab.json. A tree is any checkout holding bench/vs_torch_pipelining.py
(e.g. `mkdir /tmp/old_tree && git archive <commit> | tar -x -C /tmp/old_tree`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def child(pairs: list[str], steps: int) -> None:
    """Run in a tree: time that tree's executor on every pair, print one JSON line per pair."""
    sys.path.insert(0, str(Path.cwd() / "bench"))
    import vs_torch_pipelining as bench

    from shiftlm.launch import LocalWorkers

    with LocalWorkers(bench.PP, timeout=600) as workers:
        for pair in pairs:
            per_rank = workers.run(_time_pair, pair, steps)
            print(json.dumps({"pair": pair, "times": [max(ts) for ts in zip(*per_rank)]}), flush=True)


def _time_pair(pair: str, steps: int) -> list[float]:
    sys.path.insert(0, str(Path.cwd() / "bench"))  # this tree's bench, whichever script runs
    import torch.distributed as dist
    import vs_torch_pipelining as bench

    name, chunks, _, _ = bench.PAIRS[pair]
    ours = bench._Ours(name, chunks, 512, 64)
    ours.step()  # warm-up: shape headers, buffers
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        ours.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="source tree A")
    parser.add_argument("--new", default=".", help="source tree B (default: this checkout)")
    parser.add_argument("--pairs", default="gpipe,1f1b,interleaved_1f1b,zb_h1,zb_v,bitpipe,dualpipe_v")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per pair per child")
    parser.add_argument("--reps", type=int, default=4, help="child processes per tree")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    pairs = [p for p in args.pairs.split(",") if p]
    if args.child:
        child(pairs, args.steps)
        return
    trees = {"old": Path(args.old).resolve(), "new": Path(args.new).resolve()}
    for label, tree in trees.items():
        if not (tree / "bench" / "vs_torch_pipelining.py").exists():
            raise SystemExit(
                f"--{label} {tree}: no bench/vs_torch_pipelining.py there; pass a shiftlm checkout"
            )
    times: dict[str, dict[str, list[float]]] = {t: {p: [] for p in pairs} for t in trees}
    load = [os.getloadavg()[0]]
    for rep in range(args.reps):
        for label in list(trees) if rep % 2 == 0 else list(trees)[::-1]:
            tree = trees[label]
            command = [
                sys.executable,
                str(tree / "bench" / "pipeline_step_ab.py"),
                "--old",
                str(tree),
                "--child",
            ]
            if not (tree / "bench" / "pipeline_step_ab.py").exists():  # an old tree without this script
                command[1] = str(Path(__file__).resolve())
            command += ["--pairs", ",".join(pairs), "--steps", str(args.steps)]
            env = dict(os.environ, PYTHONPATH=str(tree))
            done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
            if done.returncode:
                raise SystemExit(f"{label} tree {tree} failed:\n{done.stderr[-3000:]}")
            for line in done.stdout.splitlines():
                row = json.loads(line)
                times[label][row["pair"]] += row["times"]
        load.append(os.getloadavg()[0])
    rows = []
    for pair in pairs:
        old, new = statistics.median(times["old"][pair]), statistics.median(times["new"][pair])
        rows.append(
            {
                "pair": pair,
                "old_median_s": old,
                "new_median_s": new,
                "old_over_new": old / new,
                "samples": len(times["new"][pair]),
            }
        )
        print(f"{pair:18s} old {old * 1e3:7.1f} ms  new {new * 1e3:7.1f} ms  old/new {old / new:5.2f}x")
    print(f"load average (1 min) over the run: {min(load):.1f}-{max(load):.1f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {
        "old": str(trees["old"]),
        "new": str(trees["new"]),
        "steps": args.steps,
        "reps": args.reps,
        "load_1min": load,
        "pairs": rows,
    }
    (RESULTS / "pipeline_step_ab.json").write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
