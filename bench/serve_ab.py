"""Two checkouts of shiftlm served side by side: `bench/vs_vllm.py` (shiftlm alone) from each tree, in
alternating runs (old, new, new, old, old, new), so that machine noise falls on both alike; medians per
load and layout, and the new/old ratio. For "no slower than before" after a change to the serving code.

    git worktree add /tmp/old <commit>
    python bench/serve_ab.py --old /tmp/old --new . --repeat 2   # writes bench/results/serve_ab.json
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

ROOT = Path(__file__).resolve().parent.parent
ORDER = ("old", "new", "new", "old", "old", "new")
LOAD = ["--vllm-python", "none", "--layouts", "tp1,tp1-sp2-shift", "--rounds", "1", "--serial-requests", "4",
        "--concurrency", "16", "--rates", "8", "--poisson-requests", "16", "--no-step-sweep", "--json"]  # fmt: skip


def run_tree(tree: Path, checkpoint: Path, out: Path) -> list[dict]:
    """One vs_vllm.py run of `tree`'s own bench with `tree` first on PYTHONPATH: its summary rows."""
    command = [sys.executable, str(tree / "bench" / "vs_vllm.py"), *LOAD, "--checkpoint-dir", str(checkpoint)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        command + ["--out", str(out)], env=env, capture_output=True, text=True, timeout=1200
    )
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: vs_vllm.py failed: {done.stderr.strip().splitlines()[-1:]}")
    text = done.stdout
    return json.loads(text[text.index("{") :])["summary"]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--old", required=True, help="the checkout before the change")
    parser.add_argument("--new", default=str(ROOT), help="the checkout after it (default: this one)")
    parser.add_argument("--work", default="/tmp/shiftlm-serve-ab", help="checkpoint and per-run outputs")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_ab.json"))
    parser.add_argument(
        "--repeat", type=int, default=1, help="times to run the old/new/new/old/old/new order"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    args = parser.parse_args()
    work = Path(args.work)
    trees = {"old": Path(args.old).resolve(), "new": Path(args.new).resolve()}
    runs: dict[tuple[str, str], dict[str, list[dict]]] = {}
    load_before = os.getloadavg()
    for index, name in enumerate(ORDER * args.repeat):
        started = time.monotonic()
        for row in run_tree(trees[name], work / "model", work / f"run{index}-{name}"):
            runs.setdefault((row["load"], row["server"]), {"old": [], "new": []})[name].append(row)
        print(
            f"run {index} {name}: {time.monotonic() - started:.0f} s, load {os.getloadavg()[0]:.1f}",
            file=sys.stderr,
        )
    rows = []
    for (load, server), by_tree in runs.items():
        median = {name: {key: statistics.median(r[key] for r in by_tree[name]) for key in ("out_tok_s", "tpot_ms", "ttft_ms")} for name in by_tree}  # fmt: skip
        rows.append(
            dict(
                load=load,
                server=server,
                old=median["old"],
                new=median["new"],
                new_over_old_tok_s=median["new"]["out_tok_s"] / median["old"]["out_tok_s"],
                old_runs_tok_s=[round(r["out_tok_s"], 1) for r in by_tree["old"]],
                new_runs_tok_s=[round(r["out_tok_s"], 1) for r in by_tree["new"]],
            )
        )
    result = dict(
        command=" ".join(
            ["python", "bench/serve_ab.py", "--old", str(trees["old"]), "--new", str(trees["new"])]
        ),
        trees={
            name: subprocess.run(
                ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
            for name, tree in trees.items()
        },  # fmt: skip
        order=list(ORDER * args.repeat),
        loadavg_before=load_before,
        loadavg_after=os.getloadavg(),
        rows=rows,
    )
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
    else:
        for row in rows:
            print(f"{row['load']:14s} {row['server']:14s} new/old tok/s {row['new_over_old_tok_s']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
