"""Shift Parallelism in the serving simulator: Llama-3.3-70B (fp8) on 8 x H100 replaying the Azure
code trace at several traffic levels, for TP, SP x TP, DP and shift (Hidayetoglu et al. 2025).

python bench/serve_sim.py [--max-requests 1000]   # table; bench/results/serve_sim.json + .png

Every run is `simulate_serving` (the real Scheduler + the cost model); nothing here is measured.
The paper reports, vs TP alone, up to 1.51x faster response at low traffic and up to 50% higher
throughput at high traffic, with SP x TP alone losing on decode latency; the summary prints our
counterparts of those three numbers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shiftlm.data import trace_path
from shiftlm.hardware import CATALOG
from shiftlm.presets import PRESETS
from shiftlm.serve.trace import load_trace, scale_trace
from shiftlm.sim.efficiency import FITTED
from shiftlm.sim.serve_runner import ServeHardware, ServeLayout
from shiftlm.sim.serve_sim import simulate_serving

TRACE = trace_path("azure_code")
RATE_SCALES = (0.25, 0.5, 1, 2, 4, 8, 16)
LAYOUTS = {
    "tp8": ServeLayout(dp=1, tp=8),
    "sp8 x tp1": ServeLayout(dp=1, tp=1, sp=8, threshold=-1),
    "sp4 x tp2": ServeLayout(dp=1, tp=2, sp=4, threshold=-1),
    "dp8 x tp1": ServeLayout(dp=8, tp=1),
    "dp4 x tp2": ServeLayout(dp=4, tp=2),
    "shift sp8 x tp1 @256": ServeLayout(dp=1, tp=1, sp=8, threshold=256),
    "shift sp4 x tp2 @256": ServeLayout(dp=1, tp=2, sp=4, threshold=256),
}
RESULTS = Path(__file__).parent / "results"


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for name in LAYOUTS:
        mine = [r for r in rows if r["name"] == name]
        x = [r["total_tokens_per_s"] / 1000 for r in mine]
        for axis, metric in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms")):
            axis.plot(x, [r[metric]["mean"] for r in mine], marker="o", label=name)
            axis.set_yscale("log")
            axis.set_xlabel("throughput (k tokens/s, input + output)")
            axis.set_ylabel(f"mean {metric[:-3].upper()} (ms)")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        "Llama-3.3-70B fp8, 8 x H100, Azure code trace at rate x " + ", ".join(map(str, RATE_SCALES))
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _ratios(rows: list[dict]) -> dict[str, float]:
    """Our counterparts of the paper's headline numbers (shift / SP x TP vs TP alone)."""

    def at(name: str, scale: float) -> dict:
        return next(r for r in rows if r["name"] == name and r["rate_scale"] == scale)

    low, high = min(RATE_SCALES), max(RATE_SCALES)
    shift, tp, sp = "shift sp8 x tp1 @256", "tp8", "sp8 x tp1"
    return {
        "low_traffic_ttft_speedup_shift_vs_tp": at(tp, low)["ttft_ms"]["mean"]
        / at(shift, low)["ttft_ms"]["mean"],
        "low_traffic_e2e_speedup_shift_vs_tp": at(tp, low)["e2e_ms"]["mean"]
        / at(shift, low)["e2e_ms"]["mean"],
        "low_traffic_tpot_sp_tp_over_tp": at(sp, low)["tpot_ms"]["mean"] / at(tp, low)["tpot_ms"]["mean"],
        "high_traffic_throughput_shift_over_tp": at(shift, high)["total_tokens_per_s"]
        / at(tp, high)["total_tokens_per_s"],
        "high_traffic_throughput_sp_tp_over_tp": at(sp, high)["total_tokens_per_s"]
        / at(tp, high)["total_tokens_per_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-requests", type=int, default=1000)
    args = parser.parse_args()
    setup = ServeHardware(PRESETS["llama-3.3-70b"], CATALOG["h100-sxm"], FITTED, "fp8", "bf16")
    trace = load_trace(TRACE)
    rows = []
    print(
        f"{'rate':>5} {'layout':22} {'TTFT mean/p99 ms':>18} {'TPOT ms':>8} {'E2E ms':>8} {'tok/s':>8} {'goodput':>8} {'switches':>8}"
    )
    for scale in RATE_SCALES:
        requests = scale_trace(trace, max_requests=args.max_requests, time_scale=1 / scale)
        for name, layout in LAYOUTS.items():
            s = simulate_serving(setup, layout, requests).summary()
            rows.append({"name": name, "rate_scale": scale} | s)
            print(
                f"{scale:>5} {name:22} {s['ttft_ms']['mean']:>9.0f}/{s['ttft_ms']['p99']:<8.0f} "
                f"{s['tpot_ms']['mean']:>8.1f} {s['e2e_ms']['mean']:>8.0f} {s['total_tokens_per_s']:>8.0f} "
                f"{s['goodput_requests_per_s']:>8.2f} {s['mode_switches']:>8}"
            )
    ratios = _ratios(rows)
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "serve_sim.json").write_text(
        json.dumps(
            {"max_requests": args.max_requests, "rate_scales": RATE_SCALES, "ratios": ratios, "rows": rows},
            indent=1,
        )
    )
    _plot(rows, RESULTS / "serve_sim.png")
    print(f"wrote {RESULTS / 'serve_sim.json'} and {RESULTS / 'serve_sim.png'}")


if __name__ == "__main__":
    main()
