"""`shiftlm train`, `shiftlm quickstart` and `shiftlm export`.

shiftlm quickstart                                   # train the embedded default, export, sample
shiftlm train --config plan.toml --nproc 4 --train.steps=200 --parallel.dp=2
torchrun --nproc-per-node 4 -m shiftlm train --config plan.toml
shiftlm export --run runs/train --to-hf out/hf       # newest checkpoint -> HF dir
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from shiftlm.train.config import TrainConfig


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _overrides(args: argparse.Namespace) -> list[str]:
    return [f"--{key}={value}" for key, value in vars(args).items() if "." in key and value is not None]


def _user_errors() -> tuple[type[Exception], ...]:
    from shiftlm.config import ConfigError
    from shiftlm.train.sources import DataError

    return (ConfigError, DataError, FileNotFoundError)


def run_training(config_dict: dict, quiet: bool = False) -> dict:
    """One rank's training run (also the entry point of `--nproc` workers); returns a summary."""
    from shiftlm.train.config import config_from_dict
    from shiftlm.train.trainer import train

    result = train(config_from_dict(config_dict), quiet=quiet)
    return {
        "steps": result.last_step,
        "losses": result.losses,
        "checkpoint": str(result.checkpoint) if result.checkpoint else None,
    }


def _launch(config: TrainConfig, nproc: int, quiet: bool) -> dict:
    """Run on this process (torchrun, or one rank) or on `nproc` local gloo workers."""
    import torch.distributed as dist

    if nproc > 1:
        from shiftlm.launch import LocalWorkers

        with LocalWorkers(nproc, timeout=24 * 3600) as workers:
            return workers.run(run_training, config.to_dict(), quiet)[0]
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():  # under torchrun
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    summary = run_training(config.to_dict(), quiet)
    return summary if not dist.is_initialized() or dist.get_rank() == 0 else {}


def cmd_train(args: argparse.Namespace) -> int:
    from shiftlm.launch import WorkerError
    from shiftlm.train.config import load_config

    try:
        config = load_config(args.config, _overrides(args))
        summary = _launch(config, args.nproc, quiet=args.json)
    except _user_errors() as err:
        return _fail(str(err))
    except WorkerError as err:
        lines = [line for line in str(err).splitlines() if line.strip()]
        return _fail(lines[-1])  # the workers' exception, e.g. "ConfigError: ..."
    if args.json and summary:
        print(json.dumps(summary))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from shiftlm.train.export import export_checkpoint

    try:
        out = export_checkpoint(Path(args.run), Path(args.to_hf), args.checkpoint)
    except _user_errors() as err:
        return _fail(str(err))
    print(json.dumps({"exported": str(out)}) if args.json else f"exported {out}")
    return 0


def cmd_quickstart(args: argparse.Namespace) -> int:
    from shiftlm.train.quickstart import quickstart

    try:
        summary = quickstart(Path(args.out), args.steps, quiet=args.json)
    except _user_errors() as err:
        return _fail(str(err))
    if args.json:
        print(json.dumps(summary))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser(
        "train",
        help="train on any dp x pp x sp x tp layout",
        allow_abbrev=False,
        description="Train. Any config key can be overridden: --section.key=value.",
    )
    train.add_argument("--config", help="TOML file (the format `shiftlm plan train` writes)")
    train.add_argument("--nproc", type=int, default=1, help="start this many local gloo workers (CPU)")
    train.add_argument("--json", action="store_true", help="print one JSON summary, no step lines")
    defaults = TrainConfig()
    for section in dataclasses.fields(defaults):
        for key in dataclasses.fields(getattr(defaults, section.name)):
            train.add_argument(
                f"--{section.name}.{key.name}",
                dest=f"{section.name}.{key.name}",
                metavar=key.type.upper(),
                default=None,
                help=f"default {getattr(getattr(defaults, section.name), key.name)!r}",
            )
    train.set_defaults(func=cmd_train)

    export = subparsers.add_parser("export", help="write a training checkpoint as a Hugging Face model dir")
    export.add_argument("--run", default="runs/train", help="the run's log.dir (default runs/train)")
    export.add_argument("--checkpoint", help="a specific checkpoint dir (default: the newest of the run)")
    export.add_argument(
        "--to-hf", required=True, help="output dir (config.json, model.safetensors, tokenizer)"
    )
    export.add_argument("--json", action="store_true")
    export.set_defaults(func=cmd_export)

    quick = subparsers.add_parser(
        "quickstart", help="train the embedded default on 2 CPU ranks, export, sample"
    )
    quick.add_argument("--out", default="runs/quickstart", help="run dir; the HF model goes to OUT/hf")
    quick.add_argument("--steps", type=int, default=None, help="training steps (default: fits ~2 minutes)")
    quick.add_argument("--json", action="store_true")
    quick.set_defaults(func=cmd_quickstart)
