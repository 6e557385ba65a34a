"""`shiftlm train`, `shiftlm quickstart` and `shiftlm export`.

shiftlm quickstart                                   # train the embedded default, export, sample
shiftlm train plan.toml --nproc 4 --train.steps=200 --parallel.dp=2
torchrun --nproc-per-node 4 -m shiftlm train plan.toml
shiftlm export --run runs/train --to-hf out/hf       # newest checkpoint -> HF dir

User errors are `shiftlm.errors.ConfigError`s (and subclasses); they propagate to `shiftlm.cli.main`,
which prints them as one line with their exit code. Errors a `--nproc` worker raises come back the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import sys
from pathlib import Path

from shiftlm.errors import ConfigError
from shiftlm.train.config import TrainConfig


def _overrides(args: argparse.Namespace) -> list[str]:
    return [f"--{key}={value}" for key, value in vars(args).items() if "." in key and value is not None]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (the number of local ranks), got {value}")
    return value


def cmd_train(args: argparse.Namespace) -> int:
    from shiftlm.launch import Interrupted, RankFailure
    from shiftlm.train.config import load_config
    from shiftlm.train.elastic import launch, resume_hint
    from shiftlm.train.stopping import exit_code

    if args.config_file and args.config and args.config_file != args.config:
        raise ConfigError(f"two config files given ({args.config_file} and --config {args.config}): pass one")
    from shiftlm.train.preflight import check_memory, check_run_dir, check_world, fill_dp, run_device
    from shiftlm.train.setup import model_shape

    overrides = _overrides(args)
    if args.overwrite:
        overrides += ["--checkpoint.resume=false", "--checkpoint.overwrite=true"]
    config = load_config(args.config_file or args.config, overrides)
    if args.overwrite and args.__dict__.get("checkpoint.resume") not in (None, "false", "False", "0"):
        raise ConfigError("--overwrite starts afresh; it cannot go with --checkpoint.resume=true: drop one")
    if (args.elastic or args.max_restarts) and not config.checkpoint.enable:
        raise ConfigError(
            f"{'--elastic' if args.elastic else '--max-restarts'} resumes from the newest checkpoint, and "
            "checkpoint.enable = false writes none: drop one"
        )
    if args.dry_run:
        return _dry_run(config, args)
    config, filled = fill_dp(config, args.nproc, _dp_given(args))
    if filled and not args.json:
        print(filled)
    model = model_shape(config)  # the layout against the model, before the world size
    check_world(config, args.nproc)
    run_device(config, args.nproc)  # the device (refusing what it cannot be) before any rank starts
    check_run_dir(config)
    if not args.skip_memory_check:
        memory = check_memory(config, model, args.nproc)
        if not args.json:
            print(
                f"memory estimate: {memory['total_gib']} GiB ({memory['ranks_sharing']} rank(s) x "
                f"{memory['per_rank_gib']['total']} GiB); {memory['device']} has {memory['available_gib']} GiB"
            )
    try:
        summary = launch(config, args.nproc, args.json, args.elastic, args.max_restarts)
    except Interrupted as err:  # before the first step boundary: nothing new to save
        print(f"[shiftlm] {interrupted_line(err.signum, config, args, False)}", file=sys.stderr, flush=True)
        return exit_code(err.signum)
    except RankFailure as err:  # the failed rank, its traceback, the others stopped, how to resume
        if err.report.kind == "usage":  # a user error on a rank: one line, its exit code
            raise ConfigError(err.report.message, err.report.code or 2) from None
        print(
            f"{err.text()}\n[shiftlm] {resume_hint(config, err.exit_code == 1)}", file=sys.stderr, flush=True
        )
        return err.exit_code
    if not summary:  # a torchrun rank other than 0
        return 0
    if args.json:
        print(json.dumps(summary))
    else:
        print(end_of_run(summary))
    if summary.get("interrupted"):
        print(f"[shiftlm] {interrupted_line(summary['interrupted'], config, args)}", file=sys.stderr)
        return exit_code(summary["interrupted"])
    return 0


# what a rerun must not repeat: these would delete (or not read) the checkpoint it should resume from
_FRESH_START = ("--overwrite", "--checkpoint.resume", "--checkpoint.overwrite")


def resume_command(argv: list[str]) -> str:
    """The command line that continues this run: the same one, without the flags that start afresh
    (a rerun under torchrun is the same torchrun command)."""
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        name = item.split("=", 1)[0]
        if name in _FRESH_START:
            skip = "=" not in item and name != "--overwrite"  # `--checkpoint.resume false`
            continue
        kept.append(item)
    command = "shiftlm " + shlex.join(kept)
    return command if "TORCHELASTIC_RUN_ID" not in os.environ else f"the same torchrun ... -m {command}"


def interrupted_line(signum: int, config: TrainConfig, args: argparse.Namespace, saved: bool = True) -> str:
    """After SIGINT/SIGTERM: where the run stopped and the exact command that continues it."""
    from shiftlm.train.checkpoint import latest_checkpoint, read_trainer_state

    name = signal.Signals(signum).name
    if not config.checkpoint.enable:
        return f"{name}: stopped without a checkpoint (checkpoint.enable is false)"
    latest = latest_checkpoint(Path(config.log.dir) / "checkpoints")
    if latest is None:
        return f"{name} before the first step: nothing to save; `shiftlm {shlex.join(args.command_line)}` starts it"
    step = read_trainer_state(latest)["step"]
    where = f"saved {latest}" if saved else f"stopped before a step ended; the newest checkpoint is {latest}"
    return f"{name}: {where} (step {step}); to resume: {resume_command(args.command_line)}"


def _dp_given(args: argparse.Namespace) -> bool:
    """Whether the command line or the config file sets parallel.dp."""
    import tomllib

    if args.__dict__.get("parallel.dp") is not None:
        return True
    path = args.config_file or args.config
    return bool(path) and "dp" in tomllib.loads(Path(path).read_text()).get("parallel", {})


def _dry_run(config: TrainConfig, args: argparse.Namespace) -> int:
    from shiftlm.train.dryrun import dry_run, phase_lines

    phases = dry_run(config, args.dry_run_ranks)
    print(json.dumps(phases) if args.json else "\n".join(phase_lines(phases)))
    return 0


def end_of_run(summary: dict) -> str:
    """The lines a run ends with: where its checkpoint, metrics and loss plot are."""
    paths = [
        f"  checkpoint  {summary['checkpoint'] or 'none'}",
        f"  metrics     {summary['metrics']}",
        f"  loss plot   {summary['loss_plot']}",
    ]
    if summary.get("already_complete"):
        head = f"run already complete at step {summary['steps']}: nothing to train (raise --train.steps to go on)"
    else:
        losses = summary["losses"]
        last = losses[max(losses)] if losses else float("nan")
        done = "stopped at" if summary.get("interrupted") else "trained to"
        head = f"{done} step {summary['steps']}, final loss {last:.4f}"
        if summary.get("val_losses"):
            val = summary["val_losses"]
            head += f", validation loss {val[max(val)]:.4f}"
    return "\n".join([head, *paths])


def cmd_export(args: argparse.Namespace) -> int:
    from shiftlm.train.checkpoint import latest_checkpoint, read_trainer_state
    from shiftlm.train.export import export_checkpoint

    out = export_checkpoint(Path(args.run), Path(args.to_hf), args.checkpoint)
    source = Path(args.checkpoint) if args.checkpoint else latest_checkpoint(Path(args.run) / "checkpoints")
    step = read_trainer_state(source)["step"]
    if args.json:
        print(json.dumps({"exported": str(out), "checkpoint": str(source), "step": step}))
    else:
        print(f"exported step {step} ({source}) to {out}")
    return 0


def cmd_quickstart(args: argparse.Namespace) -> int:
    from shiftlm.launch import Interrupted
    from shiftlm.train.quickstart import next_steps, quickstart
    from shiftlm.train.stopping import exit_code

    resume = f"to resume: shiftlm quickstart --out {shlex.quote(args.out)}" + (
        f" --steps {args.steps}" if args.steps else ""
    )
    try:
        summary = quickstart(Path(args.out), args.steps, quiet=args.json, overwrite=args.overwrite)
    except Interrupted as err:
        print(f"[shiftlm] {signal.Signals(err.signum).name} before the first step; {resume}", file=sys.stderr)
        return exit_code(err.signum)
    if args.json:
        print(json.dumps(summary))
    if summary["interrupted"]:
        name = signal.Signals(summary["interrupted"]).name
        print(
            f"[shiftlm] {name}: saved {summary['checkpoint']} (step {summary['steps']}); {resume}",
            file=sys.stderr,
        )
        return exit_code(summary["interrupted"])
    if not args.json:
        print(next_steps(summary))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser(
        "train",
        help="train on any dp x pp x sp x tp layout",
        allow_abbrev=False,
        description=(
            "Train on any dp x pp x sp x tp layout and pipeline schedule, on --nproc local CPU ranks or "
            "under torchrun. The config is a TOML file (the format `shiftlm plan train` writes); any key "
            "can be overridden with --section.key=value. docs/training.md describes every key."
        ),
    )
    train.add_argument("config_file", nargs="?", metavar="CONFIG", help="TOML config file")
    train.add_argument("--config", help="TOML config file (same as the positional CONFIG)")
    train.add_argument(
        "--nproc", type=_positive_int, default=1, help="local gloo worker processes (CPU ranks) to start"
    )
    train.add_argument("--json", action="store_true", help="print one JSON summary, no step lines")
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="check the config without its cluster: layout checks, memory estimate, one step of a tiny "
        "stand-in model with the same layout on local ranks, compared with one rank",
    )
    train.add_argument(
        "--dry-run-ranks",
        type=_positive_int,
        default=8,
        help="most local ranks the --dry-run stand-in may use (larger axes are halved, dp first)",
    )
    train.add_argument(
        "--skip-memory-check",
        action="store_true",
        help="start even if the memory estimate (the simulator's model) exceeds this device",
    )
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in log.dir, deleting the checkpoints and metrics of the run there",
    )
    train.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="relaunch after a dead or hung rank (exit 75) up to this many times, as torchrun's",
    )
    train.add_argument(
        "--elastic",
        action="store_true",
        help="relaunch without a rank named dead, hung or persistently slow (smaller dp, same global batch)",
    )
    train.add_argument(
        "--peak-tflops",
        dest="log.peak_tflops",
        metavar="TFLOPS",
        default=None,
        help="one device's peak TFLOP/s for MFU (default: from the GPU's name; MFU n/a on the CPU)",
    )
    defaults = TrainConfig()
    for section in dataclasses.fields(defaults):
        for key in dataclasses.fields(getattr(defaults, section.name)):
            train.add_argument(
                f"--{section.name}.{key.name}",
                dest=f"{section.name}.{key.name}",
                metavar=key.type.upper(),
                default=None,
                help=f"(default: {getattr(getattr(defaults, section.name), key.name)!r})",
            )
    train.set_defaults(func=cmd_train)

    export = subparsers.add_parser(
        "export",
        help="write a training checkpoint as a Hugging Face model dir",
        description="Copy a training checkpoint's model (HF safetensors, config.json, tokenizer) to a "
        "standalone Hugging Face model directory, atomically.",
    )
    export.add_argument("--run", default="runs/train", help="the run's log.dir")
    export.add_argument("--checkpoint", help="a specific checkpoint dir (default: the newest of the run)")
    export.add_argument(
        "--to-hf", required=True, help="output dir (config.json, model.safetensors, tokenizer)"
    )
    export.add_argument("--json", action="store_true", help="print one JSON object")
    export.set_defaults(func=cmd_export)

    quick = subparsers.add_parser(
        "quickstart",
        help="train the embedded default on 2 CPU ranks, export, sample",
        description="Train the embedded default (a tiny Llama on the Python standard library's source, "
        "byte-level BPE tokenizer) on 2 local CPU ranks, export it to OUT/hf and print samples.",
    )
    quick.add_argument("--out", default="runs/quickstart", help="run dir; the HF model goes to OUT/hf")
    quick.add_argument("--steps", type=_positive_int, default=None, help="training steps (default: 200)")
    quick.add_argument(
        "--overwrite",
        action="store_true",
        help="delete a finished run in OUT and train afresh (without it: refused; an unfinished run resumes)",
    )
    quick.add_argument("--json", action="store_true", help="print one JSON summary")
    quick.set_defaults(func=cmd_quickstart)
