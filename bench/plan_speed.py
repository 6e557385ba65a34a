"""Planner wall time for 8 / 512 / 3,072 GPUs (the issue asks for < 10 s at 3,072).

python bench/plan_speed.py            # prints a table, writes bench/results/plan_speed.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from shiftlm.hardware import CATALOG
from shiftlm.presets import PRESETS
from shiftlm.sim.planner import plan_training

CASES = [  # (gpus, model, seq, global batch)
    (8, "llama3-8b", 8192, 256),
    (512, "llama3-70b", 8192, 1024),
    (3072, "llama3-405b", 8192, 2048),
]


def main() -> None:
    h100 = CATALOG["h100-sxm"]
    results = []
    print(f"{'gpus':>5} {'model':12} {'layouts':>8} {'bounded':>8} {'simulated':>9} {'seconds':>8}  best")
    for gpus, name, seq, batch in CASES:
        start = time.perf_counter()
        plan = plan_training(PRESETS[name], h100, gpus, seq, batch, top_k=5)
        seconds = time.perf_counter() - start
        best = plan.ranked[0]
        layout = best.layout
        summary = f"dp{layout.dp} pp{layout.pp} sp{layout.sp} tp{layout.tp} mb{layout.micro_batch} {layout.schedule} MFU {100 * best.result.mfu:.1f}%"
        print(
            f"{gpus:>5} {name:12} {plan.enumerated:>8} {plan.fit_lower_bound:>8} {plan.simulated:>9} {seconds:>8.2f}  {summary}"
        )
        results.append(
            {
                "gpus": gpus,
                "model": name,
                "seq": seq,
                "global_batch": batch,
                "seconds": seconds,
                "enumerated": plan.enumerated,
                "pass_memory_bound": plan.fit_lower_bound,
                "simulated": plan.simulated,
                "best": summary,
            }
        )
    out = Path(__file__).parent / "results" / "plan_speed.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": "h100-sxm (simulated)", "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
