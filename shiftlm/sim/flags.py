"""The arguments every `simulate` and `plan` command shares (model, hardware, efficiencies) and how
bad input is reported: one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from shiftlm.config import compiles_by_default
from shiftlm.errors import ConfigError
from shiftlm.sim.efficiency import FIRST_PRINCIPLES, FITTED, Efficiency, measured, step_overhead_key


def add_model_args(parser: argparse.ArgumentParser) -> None:
    from shiftlm.presets import PRESETS

    group = parser.add_argument_group("model (a preset, an HF config.json, or GPT-style dims)")
    group.add_argument(
        "--model",
        help=f"a preset ({', '.join(PRESETS)}; '-' and case do not matter: llama-3-70b is llama3-70b) "
        "or the path of an HF config.json (or its checkpoint directory)",
    )
    dims = {
        "hidden": "hidden size (with --layers and --heads instead of --model)",
        "layers": "transformer layers",
        "heads": "attention heads",
        "kv-heads": "key/value heads (default: --heads, multi-head attention)",
        "ffn": "MLP intermediate size (default: 4 x --hidden)",
    }
    for name, text in dims.items():
        group.add_argument(f"--{name}", type=int, help=text)
    group.add_argument("--vocab", type=int, default=51200, help="vocabulary size (GPT dims)")


def add_hardware_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gpu", default="h100", help="catalog name (a100, h100-sxm, h200, b200, mi300x, ...) or 'this'"
    )
    parser.add_argument("--hardware", type=Path, help="hardware profile JSON (from `shiftlm calibrate`)")
    parser.add_argument(
        "--gpus", type=int, required=True, help="GPUs in the cluster (all of them, every node)"
    )
    parser.add_argument(
        "--dtype", default="bf16", choices=["bf16", "fp16", "fp8", "fp32"], help="weight and compute type"
    )
    parser.add_argument("--first-principles", action="store_true", help="use unfitted efficiencies")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def add_compile_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="simulate compiled decoder blocks (`shiftlm train --train.compile=true`) or eager ones "
        "(--no-compile); default: what `shiftlm train` does on the hardware (train.compile = auto): "
        "compiled on a GPU (a catalog one or a profile calibrated on CUDA), eager on a profile "
        "calibrated on the CPU. Eager adds the unfused pointwise ops' memory traffic and, on a "
        "calibrated profile, takes its step_overhead_eager host time instead of step_overhead_compiled",
    )


def compile_mode(args: argparse.Namespace, hardware) -> bool:
    """Whether the simulated training step runs compiled blocks: --compile / --no-compile, else what
    `shiftlm train` does on `hardware` (`compiles_by_default` of its device type). A calibrated
    profile that measured the eager host time but not the compiled one (inductor could not build
    there) is simulated eagerly, with a one-line warning, even under --compile: `shiftlm train`
    itself warns and runs eagerly where inductor cannot build (`model/compile.compile_usable`),
    so that is the step it would take."""
    compiled = compiles_by_default(hardware.device_type) if args.compile is None else args.compile
    measured_modes = {mode for mode in (True, False) if step_overhead_key(mode) in hardware.extra}
    # a catalog GPU's host time is the fitted `host_op` in either mode; a profile that measured
    # neither mode (calibrate's CPU path) has no host time in either
    if hardware.name != "this" or not measured_modes or compiled in measured_modes:
        return compiled
    from shiftlm.hardware import DEFAULT_PROFILE

    profile = args.hardware or DEFAULT_PROFILE
    if not compiled:  # `shiftlm calibrate` always measures eager: a profile edited by hand
        raise ValueError(
            f"{profile} has {step_overhead_key(True)} but no {step_overhead_key(False)}; "
            "re-run `shiftlm calibrate` on that machine to measure both"
        )
    command = "plan" if getattr(args, "plan_command", None) else "simulate"
    print(
        f"shiftlm {command}: warning: {profile} has no {step_overhead_key(True)} (inductor did not "
        "build when it was calibrated); simulating eager blocks, as `shiftlm train` runs them there",
        file=sys.stderr,
    )
    return False


def require_counts(args: argparse.Namespace, *names: str) -> None:
    """Each of these flags is a count of at least one (one line naming the flag otherwise)."""
    for name in names:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")


def model_from(args: argparse.Namespace):
    """--model (a preset or a config.json), or GPT dims from --hidden, --layers and --heads."""
    from shiftlm.presets import gpt_style, resolve_model

    if args.model:
        return resolve_model(args.model)
    if not (args.hidden and args.layers and args.heads):
        raise ValueError("give --model PRESET|config.json, or --hidden, --layers and --heads")
    return gpt_style(args.hidden, args.layers, args.heads, args.vocab, args.kv_heads, args.ffn)


def hardware_from(args: argparse.Namespace):
    from shiftlm.hardware import get_hardware

    return get_hardware(args.gpu, args.hardware)


def efficiency_for(args: argparse.Namespace, hardware, compiled: bool = False) -> Efficiency:
    """A calibrated profile's measured rates and host time of a training step in the `compiled` mode
    (`compile_mode`; serving reads no step host time), else the fitted or first-principles shares."""
    if hardware.name == "this":
        return measured(hardware.extra, compiled)
    return FIRST_PRINCIPLES if args.first_principles else FITTED


def guarded(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Bad input (a ValueError) becomes a ConfigError: `shiftlm.cli.main` prints it as the one line
    `shiftlm COMMAND: error: ...` every command uses, with exit code 2, not a traceback."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except ConfigError:
            raise
        except ValueError as err:
            raise ConfigError(str(err)) from None

    return run
