"""`shiftlm schedule`: simulate a pipeline schedule, print bubble, makespan and peak memory, plot it.

shiftlm schedule --name zb_v --pp 4 --microbatches 8 --plot zbv.png
shiftlm schedule --name interleaved_1f1b --pp 4 --microbatches 8 --chunks 2 --costs 1,1,1 --json

`--costs F,I,W` are the times of one micro-batch's forward, input-gradient and weight-gradient passes
through one rank's share of the model (1/p of the layers). A schedule with v stage-chunks per rank
runs each chunk action at 1/v of that, so makespans of different schedules compare directly.
"""

from __future__ import annotations

import argparse
import json

from shiftlm.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    from shiftlm.pipeline.schedules import SCHEDULES

    parser = subparsers.add_parser(
        "schedule", help="simulate a pipeline schedule (bubble, makespan, memory, Gantt chart)"
    )
    parser.add_argument("--name", required=True, help=f"one of: {', '.join(SCHEDULES)}")
    parser.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=None, help="stages per rank (interleaved_1f1b: v)")
    parser.add_argument(
        "--costs",
        default="1,1,1",
        help="F,I,W: forward, input-grad, weight-grad time of one micro-batch on one rank's 1/p of the model",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", default=None, help="write a Gantt chart PNG here")
    parser.set_defaults(func=run)


def _parse_costs(text: str) -> tuple[float, float, float]:
    try:
        forward, backward_input, backward_weight = (float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--costs wants three numbers F,I,W (e.g. 1,1,1), got {text!r}") from None
    if min(forward, backward_input, backward_weight) < 0:
        raise ValueError(f"--costs must not be negative, got {text!r}")
    return forward, backward_input, backward_weight


def run(args: argparse.Namespace) -> int:
    from shiftlm.pipeline.schedules import build_schedule
    from shiftlm.pipeline.simulator import ActionCosts, simulate

    try:
        forward, backward_input, backward_weight = _parse_costs(args.costs)
        schedule = build_schedule(args.name, args.pp, args.microbatches, args.chunks)
    except ValueError as err:  # one line, `shiftlm COMMAND: error: ...` (shiftlm.cli.main), exit 2
        raise ConfigError(str(err)) from None
    chunks = schedule.placement.chunks
    result = simulate(
        schedule, ActionCosts(forward / chunks, backward_input / chunks, backward_weight / chunks)
    )
    summary = {
        "name": args.name,
        "pp": args.pp,
        "microbatches": args.microbatches,
        "chunks": schedule.placement.chunks,
        "costs_per_rank_share": {"F": forward, "I": backward_input, "W": backward_weight},
        "costs_per_chunk": {
            "F": forward / chunks,
            "I": backward_input / chunks,
            "W": backward_weight / chunks,
        },
        "makespan": result.makespan,
        "bubble_fraction": result.bubble_fraction,
        "peak_activations": result.peak_activations,
        "peak_memory": result.peak_memory,
        "messages": result.messages,
    }
    if args.plot:
        from shiftlm.pipeline.plot import plot_gantt

        plot_gantt(result, f"{args.name} p={args.pp} m={args.microbatches}", args.plot)
        summary["plot"] = args.plot
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"{args.name}: pp={args.pp} microbatches={args.microbatches} chunks={schedule.placement.chunks}")
    print(f"  bubble fraction  {result.bubble_fraction:.4f}")
    print(f"  makespan         {result.makespan:g}")
    print(f"  peak activations {result.peak_activations}  (stage-chunks per rank)")
    print(f"  peak memory      {result.peak_memory}  (micro-batches of 1/p of the model)")
    print(f"  messages         {result.messages}")
    if args.plot:
        print(f"  plot             {args.plot}")
    return 0
