"""`shiftlm simulate train|validate`, `shiftlm plan train` and `shiftlm calibrate`.

    shiftlm simulate train --model llama3-70b --gpu h100 --gpus 64 --tp 8 --pp 4 --seq 8192 \\
        --micro-batch 1 --global-batch 256 --schedule zb_v
    shiftlm simulate train --hidden 12288 --layers 96 --heads 96 --gpu a100 --gpus 64 --tp 8 --pp 8
    shiftlm simulate validate [--data DIR] [--refit] [--leave-one-table-out] [--json]
    shiftlm plan train --model llama3-8b --gpu h100 --gpus 64 --seq 8192 --global-batch 512 --out train.toml
    shiftlm calibrate --out ~/.cache/shiftlm/hardware.json

`SIMULATE_COMMANDS` and `PLAN_COMMANDS` map sub-subcommand names to functions that add their parser;
the serving simulator adds `serve` to both.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from shiftlm.sim import flags, jsonout


def _simulate_train(args: argparse.Namespace) -> int:
    from shiftlm.hardware import DTYPE_BYTES
    from shiftlm.sim.layout import Layout
    from shiftlm.sim.train import simulate_step, trainer_split
    from shiftlm.sim.trainer_costs import trainer_pointwise_bytes

    model, hardware = flags.model_from(args), flags.hardware_from(args)
    flags.require_counts(args, "tp", "pp", "sp", "cp", "ep", "micro_batch", "seq", "gpus")
    from shiftlm.pipeline.schedules import SCHEDULES

    if args.pp > 1 and args.schedule not in SCHEDULES:
        raise ValueError(f"unknown --schedule {args.schedule!r}; choose one of: {', '.join(SCHEDULES)}")
    chunks = args.chunks or (SCHEDULES[args.schedule].default_chunks if args.pp > 1 else 1)
    Layout(
        dp=1, pp=args.pp, tp=args.tp, sp=args.sp, chunks=chunks if args.pp > 1 else 1, cp=args.cp
    ).check_model(model)
    cut = args.tp * args.pp * args.sp * args.cp
    dp = args.dp or args.gpus // cut
    if dp * cut != args.gpus:
        cp = f" x cp {args.cp}" if args.cp > 1 else ""
        raise ValueError(
            f"--gpus {args.gpus} != dp {dp} x pp {args.pp}{cp} x sp {args.sp} x tp {args.tp}; fix --dp or --gpus"
        )
    schedule = args.schedule if args.pp > 1 else "none"
    chunks = chunks if args.pp > 1 else 1
    compiled = flags.compile_mode(args, hardware)
    layout = Layout(
        dp=dp,
        pp=args.pp,
        tp=args.tp,
        sp=args.sp,
        micro_batch=args.micro_batch,
        global_batch=args.global_batch or dp * args.micro_batch * max(args.pp, 1),
        seq_len=args.seq,
        schedule=schedule,
        chunks=chunks,
        recompute=args.recompute,
        zero=args.zero,
        cp=args.cp,
        ep=args.ep,
        etp=args.etp,
        pointwise_bytes=trainer_pointwise_bytes(model, DTYPE_BYTES[args.dtype], compiled),
    )
    efficiency = flags.efficiency_for(args, hardware, compiled)
    eager = flags.efficiency_for(args, hardware, compiled=False)
    split = trainer_split(model, DTYPE_BYTES[args.dtype], compiled, eager)
    result = simulate_step(model, layout, hardware, efficiency, args.dtype, split)
    report = {
        "model": model.name,
        "gpu": hardware.name,
        "compile": compiled,
        "layout": layout.__dict__ | {"rank_order": list(layout.rank_order)},
    }
    report |= result.as_dict()
    if args.json:
        print(jsonout.dumps(report))
        return 0
    print(
        f"{model.name} on {args.gpus} x {hardware.name}: dp={dp} pp={args.pp}"
        + (f" cp={args.cp}" if args.cp > 1 else "")
        + (f" ep={args.ep}" if args.ep > 1 else "")
        + (f" etp={args.etp}" if args.etp and args.etp != args.tp else "")
        + f" sp={args.sp} tp={args.tp} "
        f"micro-batch={args.micro_batch} x {layout.microbatches} schedule={schedule} recompute={args.recompute} "
        f"compile={str(compiled).lower()}"
    )
    print(
        f"step {result.step_time:.3f} s  {result.tokens_per_s:,.0f} tokens/s  {result.tflops_per_gpu:.0f} TFLOP/s/GPU  "
        f"MFU {100 * result.mfu:.1f}%  bubble {100 * result.bubble_fraction:.1f}%"
    )
    print("time: " + ", ".join(f"{k} {v:.3f} s" for k, v in result.breakdown.items()))
    mem = result.memory.as_dict()
    verdict = "fits" if mem["fits"] else "OUT OF MEMORY"
    print(
        f"memory per GPU: {mem['total']} GiB of {mem['capacity']} ({verdict}): weights {mem['weights']}, "
        f"grads {mem['gradients']}, optimizer {mem['optimizer']}, activations {mem['activations']}"
    )
    return 0


def _register_simulate_train(subparsers) -> None:
    parser = subparsers.add_parser("train", help="predict one training step of a layout on a cluster")
    flags.add_model_args(parser)
    flags.add_hardware_args(parser)
    flags.add_compile_args(parser)
    parser.add_argument("--seq", type=int, default=2048, help="sequence length (tokens)")
    for name, default, text in (
        ("tp", 1, "tensor-parallel degree"),
        ("pp", 1, "pipeline stages"),
        ("sp", 1, "Ulysses sequence-parallel degree"),
        ("cp", 1, "context-parallel (ring attention) degree"),
        ("ep", 1, "expert-parallel degree (a mixture of experts; folded over dp x cp x sp, docs/moe.md)"),
        ("etp", 0, "the experts' own tensor-parallel degree (default 0: tp; docs/moe.md)"),
        ("dp", 0, "data-parallel degree (default 0: what --gpus leaves)"),
        ("micro-batch", 1, "sequences per micro-batch"),
        ("global-batch", 0, "sequences per optimizer step (default 0: dp x micro-batch x pp)"),
        ("chunks", 0, "pipeline stages per rank (default 0: the schedule's own)"),
    ):
        parser.add_argument(f"--{name}", type=int, default=default, help=text)
    parser.add_argument(
        "--schedule", default="1f1b", help="pipeline schedule (shiftlm schedule --help lists them)"
    )
    parser.add_argument(
        "--recompute",
        default="selective",
        choices=["none", "selective", "full"],
        help="activation recomputation",
    )
    parser.add_argument(
        "--zero", type=int, default=1, help="ZeRO stage: 1 optimizer state, 2 + gradients, 3 + parameters"
    )
    parser.set_defaults(func=flags.guarded(_simulate_train))


def _register_simulate_validate(subparsers) -> None:
    from shiftlm.sim.validate_cli import run_validate

    parser = subparsers.add_parser(
        "validate", help="replay the measured tables, report error per row and table"
    )
    parser.add_argument(
        "--data",
        type=Path,
        help="directory holding measured/*.csv (default: the tables shipped in shiftlm/data/measured)",
    )
    parser.add_argument(
        "--refit", action="store_true", help="refit the free parameters on the fit split (minutes)"
    )
    parser.add_argument(
        "--no-single-node", action="store_true", help="skip the 1,440 vTrain single-node rows"
    )
    parser.add_argument(
        "--leave-one-table-out",
        action="store_true",
        help="refit without each table in turn and report its error (minutes; parallel processes)",
    )
    parser.add_argument("--jobs", type=int, default=None, help="refit processes (default: all cores)")
    parser.add_argument(
        "--plot",
        type=Path,
        default=Path("simulate_validate.png"),
        help="log-log predicted-vs-measured scatter plot, one panel per dataset (default: %(default)s)",
    )
    parser.add_argument("--rows", action="store_true", help="also print every row")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=flags.guarded(run_validate))


def _plan_train(args: argparse.Namespace) -> int:
    from shiftlm.sim.planner import plan_training, train_config_toml

    model, hardware = flags.model_from(args), flags.hardware_from(args)
    flags.require_counts(args, "gpus", "seq", "global_batch", "top")
    compiled = flags.compile_mode(args, hardware)
    efficiency = flags.efficiency_for(args, hardware, compiled)
    if not args.json:  # the search simulates thousands of layouts: seconds, more on big clusters
        print(
            f"planning {model.name} on {args.gpus} x {hardware.name}, {'compiled' if compiled else 'eager'} "
            f"blocks (best layout -> {args.out}) ...",
            flush=True,
        )
    top = max(args.top, 2)  # at least two, so "why 1." compares it with the runner-up even with --top 1
    plan = plan_training(
        model,
        hardware,
        args.gpus,
        args.seq,
        args.global_batch,
        top,
        efficiency,
        args.dtype,
        compiled,
        eager_efficiency=flags.efficiency_for(args, hardware, compiled=False),
    )
    if not plan.ranked:
        raise ValueError(
            f"no layout of {model.name} fits {args.gpus} x {hardware.name}; add GPUs or shorten --seq"
        )
    best = plan.ranked[0].layout
    # train.compile only as asked: the default is `auto`, the mode `shiftlm train` takes there anyway
    args.out.write_text(train_config_toml(args.model or model.name, best, args.compile))
    rows = [
        {
            "layout": {
                k: getattr(r.layout, k)
                for k in ("dp", "pp", "sp", "tp", "micro_batch", "schedule", "recompute", "zero")
            },
            "why": r.why(),
        }
        | r.result.as_dict()
        for r in plan.ranked[: args.top]
    ]
    if args.json:
        print(
            jsonout.dumps(
                {
                    "enumerated": plan.enumerated,
                    "fit": plan.fit_lower_bound,
                    "simulated": plan.simulated,
                    "compile": compiled,
                    "config": str(args.out),
                    "top": rows,
                }
            )
        )
        return 0
    print(
        f"{plan.enumerated} layouts, {plan.fit_lower_bound} pass the memory bound, {plan.simulated} simulated"
    )
    for rank, r in enumerate(plan.ranked[: args.top], 1):
        lay = r.layout
        print(
            f"{rank}. dp={lay.dp} pp={lay.pp}{f' cp={lay.cp}' if lay.cp > 1 else ''}"
            f"{f' ep={lay.ep}' if lay.ep > 1 else ''}"
            f"{f' etp={lay.expert_tp}' if lay.expert_tp != lay.tp else ''} sp={lay.sp} tp={lay.tp} "
            f"mb={lay.micro_batch} {lay.schedule} "
            f"recompute={lay.recompute} zero={lay.zero}: {r.result.step_time:.2f} s/step, "
            f"MFU {100 * r.result.mfu:.1f}% ({r.why()})"
        )
    print(f"why 1.: {top_pick_reason(plan.ranked)}")
    print(f"wrote {args.out}: the config of 1.; check it with `shiftlm train --dry-run --config {args.out}`")
    return 0


def top_pick_reason(ranked: list) -> str:
    """One line: why the planner's first layout beats its second (the term of the step time that
    differs most) and how much memory it leaves."""
    best = ranked[0].result
    memory = f"uses {best.memory.total / 2**30:.0f} of {best.memory.capacity / 2**30:.0f} GiB per GPU"
    if len(ranked) == 1:
        return f"the only layout that fits; {memory}"
    second = ranked[1].result
    terms = {
        k: second.breakdown.get(k, 0.0) - best.breakdown.get(k, 0.0)
        for k in best.breakdown | second.breakdown
    }
    term, delta = max(terms.items(), key=lambda kv: kv[1])
    gain = 100 * (second.step_time / best.step_time - 1)
    layout = ranked[0].layout
    peers = layout.dp * layout.cp * layout.sp
    if layout.zero > 1 and peers > 1:  # at dp = 1 too: cp and sp peers hold the same weights
        memory += f"; zero={layout.zero} shards the weights' state over the dp x cp x sp = {peers} ranks that hold them"
        if layout.experts_apart:  # expert states shard over the ranks holding the same experts (sim/moe.py)
            memory += (
                f" (the experts' over their {peers * layout.tp // (layout.ep * layout.expert_tp)} edp ranks)"
            )
    return (
        f"the fastest predicted step that fits ({best.step_time:.2f} s, {gain:.1f}% faster than 2., which "
        f"spends {delta:.2f} s more in {term}); {memory}"
    )


def _register_plan_train(subparsers) -> None:
    parser = subparsers.add_parser(
        "train", help="rank the layouts that fit, write a train config for the best"
    )
    flags.add_model_args(parser)
    flags.add_hardware_args(parser)
    parser.add_argument("--seq", type=int, required=True, help="sequence length (tokens)")
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    flags.add_compile_args(parser)
    parser.add_argument("--top", type=int, default=5, help="print this many layouts, best first")
    parser.add_argument(
        "--out", type=Path, default=Path("train.toml"), help="the `shiftlm train` config of the best layout"
    )
    parser.set_defaults(func=flags.guarded(_plan_train))


def _calibrate(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    import torch

    from shiftlm.errors import check_writable_dir
    from shiftlm.hardware import DEFAULT_PROFILE, save_profile
    from shiftlm.sim.calibrate import calibrate
    from shiftlm.sim.calibrate_device import calibrate_device

    out = args.out or DEFAULT_PROFILE
    check_writable_dir(out.parent, "--out's directory")  # before minutes of measuring
    if args.engine_out is not None:
        check_writable_dir(args.engine_out.parent, "--engine-out's directory")
    if args.serve_model is not None and not (args.serve_model / "config.json").exists():
        raise ValueError(
            f"--serve-model {args.serve_model} has no config.json; pass an HF checkpoint directory"
        )
    log = (lambda _: None) if args.json else print
    if torch.cuda.is_available():  # the GPU a training rank runs on, as a step uses it
        hardware = calibrate_device(torch.device("cuda", torch.cuda.current_device()), log)
    else:
        hardware = calibrate(log=log)
    save_profile(hardware, out)
    report = {"profile": str(out)} | asdict(hardware)
    flag = "--gpu this" if out == DEFAULT_PROFILE else f"--gpu this --hardware {out}"
    report["use_with"] = flag
    if not args.json:
        print(f"wrote {out}; use it with `{flag}`")
    if args.serve_model is not None:
        from shiftlm.sim.serve_calibrate import engine_setup, profile_engine

        engine_out = args.engine_out or out.with_name("engine.json")
        setup = engine_setup(args.serve_model, hardware)
        engine = profile_engine(args.serve_model, args.tp, args.sp, setup, log=log)
        engine.save(engine_out)
        report["engine_profile"] = str(engine_out)
        report["engine"] = asdict(engine)
        if not args.json:
            print(
                f"wrote {engine_out}; use it with `shiftlm simulate serve --gpu this --hardware {out} "
                f"--engine-profile {engine_out} --model {args.serve_model}/config.json --dtype fp32 --kv-dtype fp32`"
            )
    if args.json:
        print(jsonout.dumps(report))
    return 0


def _register_simulate_serve(subparsers) -> None:
    from shiftlm.sim.serve_cli import register_simulate_serve

    register_simulate_serve(subparsers)


def _register_plan_serve(subparsers) -> None:
    from shiftlm.sim.serve_cli import register_plan_serve

    register_plan_serve(subparsers)


SIMULATE_COMMANDS: dict[str, Callable] = {
    "train": _register_simulate_train,
    "validate": _register_simulate_validate,
    "serve": _register_simulate_serve,
}
PLAN_COMMANDS: dict[str, Callable] = {"train": _register_plan_train, "serve": _register_plan_serve}


def register(subparsers) -> None:
    simulate = subparsers.add_parser("simulate", help="predict training (and serving) on a cluster")
    simulate_sub = simulate.add_subparsers(dest="simulate_command", metavar="WHAT", required=True)
    for add in SIMULATE_COMMANDS.values():
        add(simulate_sub)
    plan = subparsers.add_parser("plan", help="find the best layout")
    plan_sub = plan.add_subparsers(dest="plan_command", metavar="WHAT", required=True)
    for add in PLAN_COMMANDS.values():
        add(plan_sub)
    calibrate = subparsers.add_parser(
        "calibrate", help="measure this machine into a hardware profile (and, optionally, the serving engine)"
    )
    calibrate.add_argument("--out", type=Path, help="profile path (default ~/.cache/shiftlm/hardware.json)")
    calibrate.add_argument(
        "--serve-model", type=Path, help="also profile the serving engine on this HF checkpoint (probes)"
    )
    calibrate.add_argument("--tp", type=int, default=1, help="with --serve-model: the engine's tp")
    calibrate.add_argument("--sp", type=int, default=2, help="with --serve-model: the engine's sp")
    calibrate.add_argument(
        "--engine-out", type=Path, help="engine profile path (default: engine.json next to --out)"
    )
    calibrate.add_argument("--json", action="store_true", help="print one JSON object")
    calibrate.set_defaults(func=flags.guarded(_calibrate))
