"""The `shiftlm` command.

Each subcommand lives next to the code it drives; a module listed in COMMANDS exposes
`register(subparsers)`, which adds its parser(s) and sets `func` (called with the parsed args,
returning an exit code). Modules import heavy dependencies inside their handlers so that
`shiftlm --help` stays fast.

    shiftlm verify                      # TP x SP layouts vs Hugging Face on a tiny built-in model
    shiftlm schedule --name zbv --pp 4 --microbatches 8 --plot zbv.png
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = [
    "shiftlm.model.verify",
    "shiftlm.pipeline.cli",
    "shiftlm.sim.cli",
    "shiftlm.train.cli",
    "shiftlm.serve.cli",
    "shiftlm.monitor.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shiftlm", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMANDS:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
