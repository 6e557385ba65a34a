"""Closing the loop: predict bench/pipeline.py's measured step times from a `shiftlm calibrate` profile.

    shiftlm calibrate --out /tmp/this.json     # ~30 s
    python bench/sim_vs_measured.py --hardware /tmp/this.json [--json]

bench/pipeline.py runs LAYERS x (Linear(width, width) + tanh), fp32, split into each schedule's
stage-chunks on 2 gloo ranks, `rows` tokens per micro-batch. Here nothing is measured: each chunk's
F / I / W come from the simulator's cost model (`costs.kernels_time`: GEMM FLOPs at the calibrated
GEMM rate, elementwise bytes at the calibrated memory bandwidth), each activation send from
`collectives.p2p_time` at the calibrated gloo latency and bandwidth, and the step is the pipeline
simulator's makespan. Compared with bench/results/pipeline.json's `measured_s`; writes
bench/results/sim_vs_measured.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shiftlm.pipeline.simulator import ActionCosts, simulate
from shiftlm.sim.collectives import Links, p2p_time
from shiftlm.sim.costs import Kernel, kernels_time
from shiftlm.sim.efficiency import MEASURED
from shiftlm.sim.hardware import DEFAULT_PROFILE, Hardware, load_profile
from shiftlm.sim.train import build

RESULTS = Path(__file__).parent / "results"
FP32 = 4


def chunk_costs(layers: int, width: int, rows: int, hardware: Hardware) -> tuple[float, float, float]:
    """F, I, W seconds of `layers` x (Linear + tanh) on `rows` tokens: forward GEMM 2*rows*w^2 FLOPs,
    dgrad and wgrad one GEMM each; tanh reads x and writes y (forward), reads y and dy and writes dx
    (backward, with the bias gradient's read of dy)."""

    def gemm(name: str) -> Kernel:
        return Kernel(name, 2 * rows * width * width, FP32 * (2 * rows * width + width * width), True)

    def pointwise(name: str, tensors: int) -> Kernel:
        return Kernel(name, 0.0, FP32 * tensors * rows * width, False)

    def time(ops: list[Kernel]) -> float:
        return layers * kernels_time(ops, hardware, MEASURED, "fp32")

    forward = time([gemm("linear"), pointwise("tanh", 2)])
    backward_input = time([gemm("dgrad"), pointwise("tanh_backward", 4)])
    backward_weight = time([gemm("wgrad")])
    return forward, backward_input, backward_weight


def predict(config: dict, name: str, chunks: int, hardware: Hardware) -> float:
    """Simulated step time of schedule `name` (`chunks` stage-chunks per rank) on the bench's model."""
    schedule = build(name, config["pp"], config["microbatches"], chunks)
    layers = config["layers"] // schedule.num_stages
    forward, backward_input, backward_weight = chunk_costs(layers, config["width"], config["rows"], hardware)
    send = p2p_time(FP32 * config["rows"] * config["width"], False, Links.of(hardware, MEASURED))
    return simulate(schedule, ActionCosts(forward, backward_input, backward_weight, p2p=send)).makespan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--hardware", type=Path, default=DEFAULT_PROFILE, help="profile from `shiftlm calibrate`"
    )
    parser.add_argument("--measured", type=Path, default=RESULTS / "pipeline.json")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    hardware = load_profile(args.hardware)
    bench = json.loads(args.measured.read_text())
    config = bench["config"]
    rows = []
    for entry in bench["schedules"]:
        predicted = predict(config, entry["name"], entry["chunks"], hardware)
        rows.append(
            {
                "name": entry["name"],
                "measured_s": entry["measured_s"],
                "predicted_s": predicted,
                "error": predicted / entry["measured_s"] - 1,
            }
        )
    report = {
        "config": config,
        "hardware": {
            "gemm_gflops": hardware.flops("fp32") / 1e9,
            "memory_gb_s": hardware.hbm_bandwidth / 1e9,
            "p2p_latency_us": hardware.intra_node_latency * 1e6,
            "p2p_gb_s": hardware.intra_node_bandwidth / 1e9,
        },
        "schedules": rows,
        "mape_pct": 100 * sum(abs(r["error"]) for r in rows) / len(rows),
        "max_abs_error_pct": 100 * max(abs(r["error"]) for r in rows),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sim_vs_measured.json").write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report))
        return
    print(f"{'schedule':17s} {'measured ms':>12s} {'simulated ms':>13s} {'error':>7s}")
    for r in rows:
        print(
            f"{r['name']:17s} {r['measured_s'] * 1e3:12.1f} {r['predicted_s'] * 1e3:13.1f} {r['error']:+7.1%}"
        )
    print(f"MAPE {report['mape_pct']:.1f}%, max |error| {report['max_abs_error_pct']:.1f}%")


if __name__ == "__main__":
    main()
