"""The simulator's per-rank memory model against the trainer's measured peak, zero 0-3 x pp 1/2.

    python bench/memory_model.py --out bench/results/memory_model.json

Measured: allocation accounting (`shiftlm.train.memory_probe`: the c10 CPU allocator's bytes from the
trainer's build through 2 steps, torch.profiler memory events), the largest over the ranks, each
layout in fresh worker processes (a second profiler session in one process misses events). Model:
`shiftlm.sim.trainer_costs.trainer_memory` for the busiest rank (what the preflight and the planner
use), without the runtime reserve. Deterministic up to the ordering of gloo's asynchronous bucket
reductions against autograd's frees (ZeRO-1/2 peaks moved by up to 26 MiB between identical runs).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from shiftlm.config import ModelConfig
from shiftlm.launch import LocalWorkers
from shiftlm.train.memory_probe import allocation_peak, compare

MODEL = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=1024,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    head_dim=32,
)
RUN = [
    "--train.seq_len=256",
    "--train.micro_batch=2",
    "--train.global_batch=8",
    "--monitor.straggler_every=0",
]


def layouts() -> list[tuple[str, int, list[str]]]:
    cases = [("1 rank", 1, [])]
    for zero in range(4):
        cases.append((f"dp2 zero{zero}", 2, ["--parallel.dp=2", f"--train.zero={zero}"]))
    for zero in range(4):
        cases.append(
            (f"dp2 x pp2 1f1b zero{zero}", 4, ["--parallel.dp=2", "--parallel.pp=2", f"--train.zero={zero}"])
        )
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/memory_model.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(ModelConfig(**MODEL).to_hf_dict()))
        for name, world, layout in layouts():
            workers = LocalWorkers(world)
            try:
                per_rank = workers.run(allocation_peak, [f"--model.name={model_dir}", *RUN, *layout], tmp)
            finally:
                workers.close()
            row = {"layout": name, **compare(per_rank)}
            rows.append(row)
            print(
                f"{name:24s} measured {row['measured_mib']:7.1f} MiB  model {row['model_mib']:7.1f} MiB  "
                f"{100 * row['error']:+5.1f}%  ranks {row['ranks_mib']}",
                flush=True,
            )
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst |error| {100 * worst:.1f}% over {len(rows)} layouts")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"model": MODEL, "run": RUN, "rows": rows, "worst_abs_error": worst}, indent=1)
    )


if __name__ == "__main__":
    main()
