"""`shiftlm simulate serve` and `shiftlm plan serve`.

    shiftlm simulate serve --model llama-3.3-70b --gpu h100 --gpus 8 --dtype fp8 \\
        --trace azure_code --mode shift --shift-threshold 256 \\
        --rate-scale 2 --max-requests 2000 --slo-ttft-ms 2000 --slo-tpot-ms 100
    shiftlm plan serve --model llama-3.3-70b --gpu h100 --gpus 8 --dtype fp8 --trace ... --json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shiftlm.sim import flags, jsonout
from shiftlm.sim.serve_plan import (
    DEFAULT_THRESHOLDS,
    MODES,
    check_serve_layout,
    layout_for,
    plan_serving,
    smallest_fitting_tp,
)
from shiftlm.sim.serve_sim import ROUTINGS, EngineLimits, ServeRun, Slo, simulate_serving


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    flags.add_model_args(parser)
    flags.add_hardware_args(parser)
    parser.add_argument(
        "--kv-dtype", default="bf16", choices=["bf16", "fp16", "fp8", "fp32"], help="KV cache element type"
    )
    parser.add_argument(
        "--engine-profile",
        type=Path,
        help="host overheads of shiftlm's own engine on this machine (`shiftlm calibrate --serve-model`)",
    )
    parser.add_argument("--trace", type=Path, required=True, help="Azure CSV or JSONL trace")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="multiply the arrival rate")
    parser.add_argument("--start", type=int, default=0, help="first trace row")
    parser.add_argument("--max-requests", type=int, default=1000, help="replay at most this many requests")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="TTFT SLO in ms (goodput)")
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0, help="TPOT SLO in ms (goodput)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="sequences per engine step (as vLLM's)")
    parser.add_argument(
        "--max-tokens-per-step",
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="tokens per engine step (vLLM: --max-num-batched-tokens)",
    )
    parser.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks per replica (default: what memory leaves)"
    )


def _inputs(args: argparse.Namespace):
    from shiftlm.serve.trace import load_trace, scale_trace
    from shiftlm.sim.serve_runner import ServeHardware

    hardware = flags.hardware_from(args)
    setup = ServeHardware(
        flags.model_from(args), hardware, flags.efficiency_for(args, hardware), args.dtype, args.kv_dtype
    )
    if args.engine_profile is not None:
        from shiftlm.sim.serve_calibrate import EngineProfile

        setup = EngineProfile.load(args.engine_profile).apply(setup)
    if args.rate_scale <= 0 or args.max_requests < 1:
        raise ValueError("--rate-scale must be > 0 and --max-requests >= 1")
    flags.require_counts(args, "gpus", "max_num_seqs", "max_tokens_per_step")  # --gpus 0: "math domain error"
    if getattr(args, "tp", 0) < 0:
        raise ValueError(f"--tp {args.tp} must be >= 1 (or 0: the least that fits)")
    try:
        trace = load_trace(args.trace)
    except FileNotFoundError as err:
        raise ValueError(str(err)) from err
    requests = scale_trace(trace, args.start, args.max_requests, time_scale=1 / args.rate_scale)
    if args.num_blocks is not None and args.num_blocks < 1:
        raise ValueError("--num-blocks must be >= 1")
    limits = EngineLimits(
        max_num_seqs=args.max_num_seqs,
        max_tokens_per_step=args.max_tokens_per_step,
        num_blocks=args.num_blocks,
    )
    slo = Slo(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    return setup, requests, limits, slo


def _line(run: ServeRun, slo: Slo) -> str:
    s = run.summary()
    return (
        f"{s['layout']}: TTFT mean {s['ttft_ms']['mean']:.0f} ms (p99 {s['ttft_ms']['p99']:.0f}), "
        f"TPOT mean {s['tpot_ms'].get('mean', 0):.1f} ms (p99 {s['tpot_ms'].get('p99', 0):.1f}), "
        f"E2E mean {s['e2e_ms']['mean']:.0f} ms; {s['total_tokens_per_s']:,.0f} tokens/s prompt + output "
        f"({s['output_tokens_per_s']:,.0f} output tokens/s), {s['requests_per_s']:.2f} req/s, "
        f"goodput {s['goodput_requests_per_s']:.2f} req/s ({100 * s['slo_attainment']:.0f}% within "
        f"TTFT {1000 * slo.ttft_s:.0f} ms and TPOT {1000 * slo.tpot_s:.0f} ms), "
        f"{s['mode_switches']} mode switches"
    )


def _simulate_serve(args: argparse.Namespace) -> int:
    setup, requests, limits, slo = _inputs(args)
    tp = args.tp or (
        1 if args.mode == "tp" else smallest_fitting_tp(setup, args.mode, args.gpus, requests, limits)
    )
    layout = layout_for(args.mode, args.gpus, tp, args.shift_threshold)
    check_serve_layout(setup, layout)
    run = simulate_serving(setup, layout, requests, limits, slo, args.routing)
    summary = {"model": setup.model.name, "gpu": setup.hardware.name, "gpus": args.gpus} | run.summary()
    if args.json:
        print(jsonout.dumps(summary))
        return 0
    print(
        f"{setup.model.name} ({args.dtype}) on {args.gpus} x {setup.hardware.name}, {len(requests)} requests"
    )
    print(_line(run, slo))
    print(
        f"steps {run.steps} ({run.steps_per_mode}), preemptions {run.preemptions}, "
        f"KV blocks per replica {run.kv_blocks_per_replica}"
    )
    return 0


def register_simulate_serve(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="replay a trace on a serving layout (real scheduler, cost model)"
    )
    _add_serve_args(parser)
    parser.add_argument(
        "--mode",
        choices=MODES,
        required=True,
        help="tp: one TP group; dp: TP replicas; sp_tp: SP x TP; shift: full TP or SP x TP per step",
    )
    parser.add_argument(
        "--tp", type=int, default=0, help="TP inside each replica / SP group (default: least that fits)"
    )
    parser.add_argument(
        "--shift-threshold", type=float, default=256, help="TP for steps with <= this many tokens"
    )
    parser.add_argument("--routing", choices=ROUTINGS, default="least_loaded", help="DP request routing")
    parser.set_defaults(func=flags.guarded(_simulate_serve))


def _plan_serve(args: argparse.Namespace) -> int:
    setup, requests, limits, slo = _inputs(args)
    thresholds = tuple(args.thresholds) if args.thresholds else DEFAULT_THRESHOLDS
    plan = plan_serving(setup, args.gpus, requests, limits, slo, thresholds)
    if not plan.ranked:
        raise ValueError(
            f"no layout of {setup.model.name} fits {args.gpus} x {setup.hardware.name}; add GPUs"
        )
    best = plan.ranked[0]
    if args.json:
        print(
            jsonout.dumps(
                {
                    "best": {"layout": best.layout.name, "threshold": best.layout.threshold}
                    | {"tp": best.layout.tp, "sp": best.layout.sp, "replicas": best.layout.dp},
                    "ranked": [run.summary() for run in plan.ranked],
                    "dropped": plan.dropped,
                }
            )
        )
        return 0
    print(f"{len(plan.ranked)} layouts simulated on {len(requests)} requests; {len(plan.dropped)} do not fit")
    for rank, run in enumerate(plan.ranked[: args.top], 1):
        print(f"{rank}. {_line(run, slo)}")
    print(f"suggested: {best.layout.name}")
    return 0


def register_plan_serve(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="suggest the serving layout and shift threshold for a trace")
    _add_serve_args(parser)
    parser.add_argument(
        "--thresholds", type=int, nargs="+", help=f"shift thresholds to try {DEFAULT_THRESHOLDS}"
    )
    parser.add_argument("--top", type=int, default=5, help="print this many layouts, best first")
    parser.set_defaults(func=flags.guarded(_plan_serve))
