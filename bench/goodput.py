"""Goodput of `shiftlm train --nproc N` through a rank failure: plain restart vs elastic shrink.

    python bench/goodput.py                      # table + bench/results/goodput.{json,png}
    python bench/goodput.py --steps 30 --kill-step 12 --json

Goodput = useful optimizer steps / wall-clock seconds of the whole command, process start, failure,
detection, restart and lost steps included (a step is useful once it is in the final model). Every
scenario is a real `shiftlm train` CLI process on local gloo ranks (dp = N, the micro model):

    no fault            the reference
    kill + restart      rank 1 is SIGKILLed at --kill-step in the first attempt only (a transient
                        fault: the host comes back); --max-restarts 1 relaunches the same layout
    kill + elastic      rank 1's slot is SIGKILLed at --kill-step in every attempt it runs in (a
                        broken host); --elastic relaunches without it (dp N -> N-1, same global batch)
    broken host + restart
                        the same broken host with --max-restarts 2: every relaunch dies at the same
                        step; the job fails and only the checkpointed steps are useful
    slow + elastic      rank 1 sleeps --slow-ms before every collective; --elastic excludes it once
                        the straggler watch has named it in 3 consecutive checks
    slow + no action    the same slow rank, left in

Scenarios run one after the other, so the machine's load (shared, noisy) hits them unevenly: repeat
with --repeats and read the spread. On one CPU host fewer ranks are not slower per step the way fewer
GPUs would be; the point measured here is the time lost to the failure and to the restart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCENARIOS = {
    "no fault": ([], None),
    "kill + restart": (["--max-restarts=1"], "kill:rank=1,step={k},attempt=0"),
    "kill + elastic": (["--elastic"], "kill:rank=1,step={k}"),
    "broken host + restart": (["--max-restarts=2"], "kill:rank=1,step={k}"),
    "slow + elastic": (["--elastic"], "slow:rank=1,ms={ms}"),
    "slow + no action": ([], "slow:rank=1,ms={ms}"),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--kill-step", type=int, default=12)
    parser.add_argument("--slow-ms", type=float, default=150.0)
    parser.add_argument("--straggler-every", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset")
    parser.add_argument("--json", action="store_true", help="print the JSON, no table")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "goodput.json"))
    return parser.parse_args(argv)


def run_scenario(name: str, args, run_dir: Path) -> dict:
    extra, fault = SCENARIOS[name]
    command = [
        sys.executable,
        "-m",
        "shiftlm",
        "train",
        "--json",
        f"--nproc={args.nproc}",
        "--model.name=micro",
        f"--parallel.dp={args.nproc}",
        "--train.seq_len=32",
        f"--train.global_batch={2 * args.nproc}",
        f"--train.steps={args.steps}",
        "--optim.warmup_steps=2",
        f"--checkpoint.every={args.checkpoint_every}",
        f"--monitor.straggler_every={args.straggler_every}",
        "--monitor.watchdog_s=30",
        "--log.progress=off",
        f"--log.dir={run_dir}",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("SHIFTLM_FAULT", None)
    if fault:
        env["SHIFTLM_FAULT"] = fault.format(k=args.kill_step, ms=args.slow_ms)
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    wall = time.monotonic() - start
    useful = args.steps if done.returncode == 0 else _checkpointed_step(run_dir)
    restarts = _restarts(run_dir)
    return {
        "scenario": name,
        "fault": env.get("SHIFTLM_FAULT"),
        "flags": extra,
        "exit_code": done.returncode,
        "wall_s": wall,
        "useful_steps": useful,
        "goodput_steps_per_s": useful / wall,
        "restarts": len(restarts),
        "excluded": [r for event in restarts for r in event.get("excluded", [])],
        "final_world": restarts[-1]["world"] if restarts else args.nproc,
        "stderr_tail": done.stderr[-600:] if done.returncode else "",
    }


def _checkpointed_step(run_dir: Path) -> int:
    steps = [int(p.name.rsplit("_", 1)[-1]) for p in (run_dir / "checkpoints").glob("step_*")]
    return max(steps, default=0)


def _restarts(run_dir: Path) -> list[dict]:
    path = run_dir / "restarts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(row["scenario"] for row in rows))
    means = [statistics.fmean(r["goodput_steps_per_s"] for r in rows if r["scenario"] == n) for n in names]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.barh(names[::-1], means[::-1], color="tab:blue")
    ax.set_xlabel("goodput (useful steps / s, whole run)")
    ax.set_title("shiftlm train --nproc: goodput through a rank failure (2-core CPU host, loaded)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    names = [n.strip() for n in args.scenarios.split(",")]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"error: unknown scenario {unknown[0]!r}; known: {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for index, name in enumerate(names):
                rows.append({"repeat": repeat, **run_scenario(name, args, Path(tmp) / f"r{repeat}-{index}")})
                if not args.json:
                    row = rows[-1]
                    print(
                        f"{name:<22} exit {row['exit_code']:>3}  {row['useful_steps']:>3} steps in "
                        f"{row['wall_s']:6.1f} s = {row['goodput_steps_per_s']:.3f} steps/s  restarts "
                        f"{row['restarts']} excluded {row['excluded']} final world {row['final_world']}",
                        flush=True,
                    )
    result = {"config": {k: v for k, v in vars(args).items() if k not in ("json", "out")}, "runs": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(rows, out.with_suffix(".png"))
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
