"""Compiled training blocks (`train.compile`): each decoder layer's forward is `torch.compile`d on its own.

torchtitan's per-block way (`apply_compile`): the layers share one code object and dynamo does not
specialise on which layer it is (parameters are graph inputs), so the first layer's graph serves
every layer and compile time does not grow with depth. Activation recomputation (`train/recompute.py`)
wraps the compiled block: `full` checkpoints the compiled forward (its backward reruns the compiled
forward), `selective` runs the compiled block under the mode that checkpoints the attention core
(dynamo traces that checkpoint into the graph). ZeRO-3's gather/free hooks wrap it from outside. The
collectives of TP/SP and the cp ring trace as custom ops (comm/ops.py, model/ring_attention.py), so
a block is one graph on every layout (tests/train/test_compile.py checks tp2, sp2, cp2).

How a linear runs is the caller's choice, passed to every layer as `ops` (model/ops.py): a forward
with `PLAIN` ops (the trainer without a pipeline, a pipeline's B micro-batches) runs the compiled
block, whose linears are `F.linear` in the graph; a forward the executor will split into I + W
(zero-bubble schedules) passes `DEFERRABLE`, whose weight gradients are queued in Python at backward
time, so that block runs eagerly.

Where inductor cannot build kernels (no C++ compiler on the CPU, no Triton on the GPU) training warns
in one line and runs eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from shiftlm.config import compiles_by_default
from shiftlm.model import Transformer
from shiftlm.model.ops import PLAIN

log = logging.getLogger(__name__)


def wants_compile(setting: str, device: torch.device) -> bool:
    """`train.compile`: auto compiles where `compiles_by_default` says (CUDA, not the CPU)."""
    if setting == "auto":
        return compiles_by_default(device.type)
    return setting == "true"


def compile_usable(
    setting: str, device: torch.device, what: str, silence: str = "set it to false to silence this"
) -> bool:
    """Whether `setting` (auto / true / false) asks to compile on `device` and inductor can build
    there; where it asks but cannot, one warning line naming `what` (and how to `silence` it) runs
    eagerly."""
    if not wants_compile(setting, device):
        return False
    problem = inductor_problem(device)
    if problem is not None:
        log.warning("%s: %s; running eagerly (%s)", what, problem, silence)
    return problem is None


def inductor_problem(device: torch.device) -> str | None:
    """Why inductor cannot build kernels for `device` (None if it can): the CPU backend needs a
    working C++ compiler, the CUDA one Triton. Checked up front, not by compiling: inductor's cache
    may hold a probe's kernels and hide a missing compiler until a new kernel is needed."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is not installed (pip install triton)"
    if device.type != "cpu":
        return f"inductor has no backend for device {device.type!r} here"
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except Exception as err:  # InvalidCxxCompiler and whatever a broken toolchain raises
        return str(err).splitlines()[0] or type(err).__name__
    return None


class CompiledBlock:
    """A decoder layer's forward: compiled for `PLAIN` ops (the `ops` keyword the transformer passes),
    eager for any other. The first compiled call that fails to build (a toolchain inductor's check missed) warns once
    and turns every block eager; a compile failure runs nothing, so the eager rerun is the same step."""

    broken: str | None = None  # set by the first build failure: every block runs eagerly from then on

    def __init__(self, eager: Callable[..., Any]):
        self.eager = eager
        self.compiled = torch.compile(eager)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("ops", PLAIN) is not PLAIN or CompiledBlock.broken is not None:
            return self.eager(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as err:
            CompiledBlock.broken = str(err).splitlines()[0]
            log.warning("train.compile: inductor failed (%s); training eagerly", CompiledBlock.broken)
            return self.eager(*args, **kwargs)


def compile_blocks(stages: list[Transformer], device: torch.device, setting: str = "true") -> bool:
    """Compile each decoder layer of `stages` as `train.compile` = `setting` asks; returns False
    where it does not, or (after one warning line) where inductor cannot build for `device`."""
    if not compile_usable(setting, device, "train.compile"):
        return False
    for stage in stages:
        for layer in stage.model.layers.values():
            layer.forward = CompiledBlock(layer.forward)
    return True
