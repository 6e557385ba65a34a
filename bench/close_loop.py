"""Closing the loop (issue 17) in one command: calibrate this machine, measure, predict, compare.

    python bench/close_loop.py --out-dir /tmp/loop1            # ~8-10 minutes on a quiet 2-core box
    python bench/close_loop.py --out-dir /tmp/loop1 --quick    # ~3 minutes: checks the chain runs
    python bench/close_loop.py --out-dir /tmp/loop1 --json     # one JSON object on stdout at the end

Runs, in sequence, each as its own process (so each stage measures in a clean interpreter), every
file written under `--out-dir`:
1. `shiftlm calibrate --out profile.json`                       hardware profile (GEMM rates, gloo)
2. `bench/pipeline.py --out DIR`                                every pipeline schedule, measured
3. `bench/sim_vs_measured.py --hardware profile.json`           the schedules predicted -> pipeline_sim.json
4. `bench/serve_sim_vs_measured.py --probe-only`                the serving engine's probes -> engine.json
5. `bench/serve_modes.py --out DIR`                             the serving trace, measured
6. `bench/serve_sim_vs_measured.py --engine-profile engine.json` the serving steps predicted -> serve_sim.json
The probe servers' step logs land in DIR/probe_steps (with probes.json, the step span of every probe
replay) and the measured servers' in DIR/serve_steps. Prints one line per stage (its wall time and headline), then one summary: per-schedule pipeline
error, serving TTFT/TPOT and per-step MAPE, and the goal flags (every schedule within 10%, per-step
MAPE <= 15%), with the load average before and after; `--json` prints the summary as JSON (also
written to DIR/summary.json). Timings on a shared machine are only as quiet as the machine: compare
two loops, and read the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
# --quick: a small pipeline model and a short serving trace (one rate, one round); checks the chain
QUICK_SERVE = ["--rates", "4", "--repeats", "1", "--max-requests", "12", "--switch-repeats", "10"]


def _load() -> list[float]:
    return list(os.getloadavg())


def stages(out: Path, quick: bool) -> list[tuple[str, list[str]]]:
    """(name, argv) of every stage, in order."""
    py = sys.executable
    profile, engine = out / "profile.json", out / "engine.json"
    return [
        ("calibrate", [py, "-m", "shiftlm.cli", "calibrate", "--out", str(profile)]),
        ("pipeline", [py, str(BENCH / "pipeline.py"), "--out", str(out)] + (["--quick"] if quick else [])),
        (
            "pipeline_sim",
            [
                py,
                str(BENCH / "sim_vs_measured.py"),
                "--hardware",
                str(profile),
                "--measured",
                str(out / "pipeline.json"),
                "--out",
                str(out / "pipeline_sim.json"),
            ],
        ),
        (
            "serve_probe",
            [
                py,
                str(BENCH / "serve_sim_vs_measured.py"),
                "--hardware",
                str(profile),
                "--probe-only",
                "--engine-out",
                str(engine),
                "--step-log-dir",
                str(out / "probe_steps"),
            ],
        ),
        (
            "serve_modes",
            [py, str(BENCH / "serve_modes.py"), "--out", str(out), "--step-log-dir", str(out / "serve_steps")]
            + (QUICK_SERVE if quick else []),
        ),
        (
            "serve_sim",
            [
                py,
                str(BENCH / "serve_sim_vs_measured.py"),
                "--hardware",
                str(profile),
                "--engine-profile",
                str(engine),
                "--measured",
                str(out / "serve_modes.json"),
                "--out",
                str(out / "serve_sim.json"),
            ],
        ),
    ]


def headline(name: str, out: Path) -> str:
    """One line of what a stage produced, read back from its file."""
    if name == "calibrate":
        profile = json.loads((out / "profile.json").read_text())
        return f"profile.json: {len(profile.get('gemm_table', []))} GEMM rates"
    if name == "pipeline":
        rows = json.loads((out / "pipeline.json").read_text())["schedules"]
        return "measured ms: " + ", ".join(f"{r['name']} {r['measured_s'] * 1e3:.0f}" for r in rows)
    if name == "pipeline_sim":
        report = json.loads((out / "pipeline_sim.json").read_text())
        return f"MAPE {report['mape_pct']:.1f}%, max |error| {report['max_abs_error_pct']:.1f}%"
    if name == "serve_probe":
        return f"engine.json written ({(out / 'engine.json').stat().st_size} bytes)"
    if name == "serve_modes":
        return f"{len(json.loads((out / 'serve_modes.json').read_text())['runs'])} replays"
    report = json.loads((out / "serve_sim.json").read_text())
    return f"TTFT/TPOT MAPE {report['mape_pct']:.1f}%, per-step MAPE {report['step_mape_pct']:.1f}%"


def summary(out: Path, seconds: dict[str, float], load: dict[str, list[float]]) -> dict:
    pipeline = json.loads((out / "pipeline_sim.json").read_text())
    serve = json.loads((out / "serve_sim.json").read_text())
    return {
        "out_dir": str(out),
        "stage_seconds": seconds,
        "total_seconds": sum(seconds.values()),
        "load_average": load,
        "pipeline": {
            "schedules": {
                r["name"]: {
                    "measured_ms": r["measured_s"] * 1e3,
                    "simulated_ms": r["predicted_s"] * 1e3,
                    "error_pct": 100 * r["error"],
                }
                for r in pipeline["schedules"]
            },
            "mape_pct": pipeline["mape_pct"],
            "max_abs_error_pct": pipeline["max_abs_error_pct"],
            "goal_every_schedule_within_pct": pipeline["goal_every_schedule_within_pct"],
            "goal_met": pipeline["goal_met"],
        },
        "serve": {
            "ttft_tpot_mape_pct": serve["mape_pct"],
            "step_mape_pct": serve["step_mape_pct"],
            "step_weighted_mape_pct": serve["step_weighted_mape_pct"],
            "step_buckets": len(serve["steps"]),
            "step_loop_gap_removed": serve["step_loop_gap_removed"],
            "step_goal_met": serve["step_goal_met"],
        },
        "goal_met": bool(pipeline["goal_met"] and serve["step_goal_met"]),
    }


def print_summary(report: dict) -> None:
    pipeline, serve = report["pipeline"], report["serve"]
    print(f"\n{'schedule':17s} {'measured ms':>12s} {'simulated ms':>13s} {'error':>7s}")
    for name, r in pipeline["schedules"].items():
        print(f"{name:17s} {r['measured_ms']:12.1f} {r['simulated_ms']:13.1f} {r['error_pct']:+6.1f}%")
    print(
        f"pipeline: MAPE {pipeline['mape_pct']:.1f}%, max |error| {pipeline['max_abs_error_pct']:.1f}%; every schedule "
        f"within {pipeline['goal_every_schedule_within_pct']:.0f}%: {'met' if pipeline['goal_met'] else 'NOT met'}"
    )
    print(
        f"serving: TTFT/TPOT MAPE {serve['ttft_tpot_mape_pct']:.1f}%, per-step MAPE {serve['step_mape_pct']:.1f}% over "
        f"{serve['step_buckets']} buckets ({serve['step_weighted_mape_pct']:.1f}% weighted); per-step <= 15%: "
        f"{'met' if serve['step_goal_met'] else 'NOT met'}"
    )
    before, after = report["load_average"]["before"], report["load_average"]["after"]
    print(
        f"load average {before[0]:.1f} -> {after[0]:.1f}; total {report['total_seconds']:.0f} s; "
        f"both goals: {'met' if report['goal_met'] else 'NOT met'}; files in {report['out_dir']}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True, help="every file of the loop goes here")
    parser.add_argument("--quick", action="store_true", help="small settings: checks the chain (~3 min)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    args = parser.parse_args()
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    )
    seconds, load = {}, {"before": _load()}
    log = sys.stderr if args.json else sys.stdout
    for index, (name, argv) in enumerate(stages(out, args.quick), 1):
        start = time.perf_counter()
        with (out / f"{name}.log").open("w") as handle:
            code = subprocess.run(argv, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT).returncode
        seconds[name] = time.perf_counter() - start
        if code != 0:
            print(
                f"[{index}/6] {name} failed (exit {code}) after {seconds[name]:.0f} s; see {out / (name + '.log')}",
                file=sys.stderr,
            )
            return 1
        print(f"[{index}/6] {name:12s} {seconds[name]:6.1f} s  {headline(name, out)}", file=log, flush=True)
    load["after"] = _load()
    report = summary(out, seconds, load)
    (out / "summary.json").write_text(json.dumps(report, indent=1) + "\n")
    if args.json:
        print(json.dumps(report))
    else:
        print_summary(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
