"""The `shiftlm` command: train, serve, verify, simulate and plan one LLM across many devices.

Each subcommand lives next to the code it drives: a module in COMMANDS exposes `register(subparsers)`,
which adds its parser(s) and sets `func` (called with the parsed args, returning an exit code). Only
the module of the command being run is imported, so `shiftlm --help` and `shiftlm --version` never
import torch.

Every user error is one line on stderr, `shiftlm COMMAND: error: <what is wrong>: <the fix>`, and an
exit code from `shiftlm.errors.EXIT_CODES` (2 usage/config/layout, 3 checkpoint or model file,
4 data source, 5 does not fit in memory, 6 run directory conflict, 75 hung/dead rank, 130 Ctrl-C).
An unrecognised flag gets "did you mean"; anything else that escapes is a bug and keeps its traceback.

    shiftlm quickstart --out quickstart          # train the embedded default, export, sample
    shiftlm train small.toml --parallel.dp=2 --nproc 2
    shiftlm schedule --name zb_v --pp 4 --microbatches 8 --plot zbv.png
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
from typing import NamedTuple, NoReturn

DESCRIPTION = """\
Train, serve, verify, simulate and plan one LLM (Llama, Qwen2, Mistral; Hugging Face checkpoints)
across many devices: tensor, Ulysses sequence, pipeline and data parallelism for training; Shift
Parallelism (full TP at low load, SP x TP at high load, over one KV cache) behind an OpenAI-compatible
server for serving; a simulator and planner that predict both on a real cluster.

  shiftlm quickstart --out quickstart                # train the embedded default, export, sample
  shiftlm serve --model quickstart/hf --sp 2         # serve it (OpenAI API on :8000)
  shiftlm train plan.toml --nproc 4 --train.steps=200"""


class Command(NamedTuple):
    module: str
    help: str


# command -> the module that registers it, and its one-line description (top-level --help reads only this)
COMMANDS = {
    "quickstart": Command("shiftlm.train.cli", "train the embedded default on 2 CPU ranks, export, sample"),
    "train": Command("shiftlm.train.cli", "train on any dp x pp x sp x tp layout and pipeline schedule"),
    "export": Command("shiftlm.train.cli", "write a training checkpoint as a Hugging Face model dir"),
    "verify": Command(
        "shiftlm.tools.verify", "check that TP x SP layouts compute what transformers computes"
    ),
    "serve": Command("shiftlm.serve.cli", "OpenAI-compatible server with Shift Parallelism"),
    "bench": Command("shiftlm.serve.cli", "replay a request trace against a server or an in-process engine"),
    "schedule": Command("shiftlm.pipeline.cli", "a pipeline schedule: bubble, makespan, memory, Gantt chart"),
    "simulate": Command("shiftlm.sim.cli", "predict a training step or a serving trace on a cluster"),
    "plan": Command("shiftlm.sim.cli", "rank the layouts that fit; write a train config / shift threshold"),
    "calibrate": Command("shiftlm.sim.cli", "measure this machine into a hardware profile for --gpu this"),
    "monitor": Command(
        "shiftlm.monitor.cli", "straggler and hang analysis of the collective ledgers of a run"
    ),
}


class UsageError(Exception):
    """A command line argparse cannot read; `main` prints it as one line and exits 2."""

    def __init__(self, prog: str, message: str):
        super().__init__(message)
        self.prog = prog


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written, and every option's default shown (as ArgumentDefaultsHelpFormatter),
    unless it is None/False or the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            text
            and "default" not in text.lower()
            and default not in (None, False, argparse.SUPPRESS)
            and (action.option_strings or action.nargs in ("?", "*"))
        ):
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (raised, not printed) and defaults shown in --help.

    Subcommand parsers are of the same class (argparse's `parser_class` default), so every command's
    bad flag is reported the same way."""

    def __init__(self, *args, **kwargs):
        if kwargs.get("formatter_class") in (
            None,
            argparse.HelpFormatter,
            argparse.RawDescriptionHelpFormatter,
            argparse.ArgumentDefaultsHelpFormatter,
        ):
            kwargs["formatter_class"] = HelpFormatter
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, f"{message}; see {self.prog} --help")


def _suggest(flag: str, parser: argparse.ArgumentParser) -> str:
    """'--train.stpes=3' -> ' did you mean --train.steps?' (difflib over the parser's flags)."""
    name = flag.split("=", 1)[0]
    if not name.startswith("-"):
        return ""
    close = difflib.get_close_matches(name, list(parser._option_string_actions), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _deepest_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser that handled the command line, following the chosen subcommands."""
    while True:
        action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        chosen = getattr(args, action.dest, None) if action is not None else None
        if chosen is None or chosen not in action.choices:
            return parser
        parser = action.choices[chosen]


def _command_of(argv: list[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(command: str | None = None) -> Parser:
    """The parser: the module of `command` registers its real subparsers; the other commands are
    listed by name and description only (so nothing heavy is imported for `shiftlm --help`)."""
    from shiftlm import __version__
    from shiftlm.errors import EXIT_CODES

    codes = "\n".join(f"  {code:>3}  {meaning}" for code, meaning in EXIT_CODES.items())
    parser = Parser(
        prog="shiftlm",
        description=DESCRIPTION,
        epilog=f"exit codes:\n{codes}\n\n`shiftlm COMMAND --help` describes each command and its flags.",
    )
    parser.add_argument("--version", action="version", version=f"shiftlm {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    if command in COMMANDS:
        importlib.import_module(COMMANDS[command].module).register(subparsers)
    for name, spec in COMMANDS.items():
        if name not in subparsers.choices:
            subparsers.add_parser(name, help=spec.help, description=spec.help)
    order = list(COMMANDS)
    # list the commands in COMMANDS order, each with COMMANDS' description
    subparsers._choices_actions.sort(key=lambda a: order.index(a.dest) if a.dest in order else len(order))
    for action in subparsers._choices_actions:
        if action.dest in COMMANDS:
            action.help = COMMANDS[action.dest].help
    for name, sub in subparsers.choices.items():  # every command's --help opens with what it does
        if not sub.description and name in COMMANDS:
            sub.description = COMMANDS[name].help
    return parser


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll reports an error on its write end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, ValueError, OSError):  # no poll here, or stdout is no file
        return False


def main(argv: list[str] | None = None) -> int:
    """Run one `shiftlm` command; returns its exit code (user errors: one line on stderr)."""
    from shiftlm.errors import ConfigError, error_line

    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command_of(argv)
    prog = f"shiftlm {command}" if command in COMMANDS else "shiftlm"
    try:
        if command is not None and command not in COMMANDS:
            close = difflib.get_close_matches(command, list(COMMANDS), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"commands: {', '.join(COMMANDS)}"
            raise UsageError("shiftlm", f"unknown command {command!r}; {hint}")
        parser = build_parser(command)
        args, extras = parser.parse_known_args(argv)
        if extras:
            sub = _deepest_parser(parser, args)
            raise UsageError(
                sub.prog,
                f"unrecognized argument {extras[0]}{_suggest(extras[0], sub)}"
                f"{'' if len(extras) == 1 else f' (and {len(extras) - 1} more)'}; see {sub.prog} --help",
            )
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        args.command_line = argv  # what the user typed (a resume hint repeats it)
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe fails here, inside the handlers below, not at exit
        return code
    except UsageError as err:
        print(error_line(err.prog, str(err)), file=sys.stderr)
        return 2
    except ConfigError as err:
        print(error_line(prog, str(err)), file=sys.stderr)
        return err.exit_code
    except BrokenPipeError:
        if not _stdout_closed():  # another pipe or socket broke: not the user's doing
            raise
        # the reader went away (`| head`): stop quietly, as Unix tools do, with what a shell reports
        # for them (128 + SIGPIPE); stdout to /dev/null, or the exit's flush would fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as err:  # a path the user named (missing, a file in the way, not allowed, ...)
        if err.filename is None:
            raise
        what = f"{err.strerror}: {err.filename}: check the path"
        print(error_line(prog, what), file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as err:
        from shiftlm.extras import missing_extra

        fix = missing_extra(err)
        if fix is None:
            raise
        print(f"{prog}: error: {fix}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
