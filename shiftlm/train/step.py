"""Forward and backward of one optimizer step's micro-batches on this rank.

The loss of a micro-batch is the *sum* of its per-token cross-entropies divided by the number of
target tokens in the whole global batch (`normalised_loss`), on every path: without a pipeline the
micro-batches run back to back, with one the executor calls the same function on the last stage.
Summing these over micro-batches and over the data group gives the global mean loss, and summing
their gradients gives the gradient of the global mean, so no later division is needed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from shiftlm.config import ModelConfig
from shiftlm.mesh import Mesh, check_dtype
from shiftlm.model import Transformer, build_model, stage_layers
from shiftlm.model.ops import PLAIN
from shiftlm.model.ring_attention import sequence_indices
from shiftlm.train.config import TrainConfig
from shiftlm.train.moe import RouterStatsStage, aux_loss_active, aux_loss_share, router_stats
from shiftlm.train.recompute import apply_recompute
from shiftlm.train.streams import stream_context

log = logging.getLogger(__name__)


def build_stages(
    model: ModelConfig, mesh: Mesh, config: TrainConfig, checkpoint: Path | None
) -> list[Transformer]:
    """This rank's pipeline stages, in `stage_keys` order: one, `chunks` of them for interleaved / V
    schedules, 2 x 2 for BitPipe (both replicas' copies start from the same seeded init or checkpoint).
    Compiled blocks (`train.compile`) and activation recomputation (`train.recompute`, around the
    compiled blocks) are applied here."""
    from shiftlm.model.compile import compile_blocks
    from shiftlm.train.pipeline import resolved_chunks, stage_keys

    total = mesh.config.pp * resolved_chunks(config)
    stages = [
        build_model(
            model, mesh, checkpoint, seed=config.train.seed, layers=stage_layers(model.num_layers, total, s)
        )
        for s, _ in stage_keys(config, mesh)
    ]
    for stage in stages:
        stage.loss_chunk = config.train.loss_chunk
    compiled = compile_blocks(stages, mesh.device, config.train.compile)
    if compiled and mesh.config.pp > 1 and mesh.rank == 0:
        _warn_split_micro_batches(config)
    for stage in stages:
        apply_recompute(stage, config.train.recompute, compiled)
    return stages


def _warn_split_micro_batches(config: TrainConfig) -> None:
    """One line where compiled blocks meet a schedule that splits backwards into I + W: those
    micro-batches queue their weight gradients from Python and run eagerly (model/compile.py), which
    `shiftlm simulate|plan train` prices too; a user who asked to compile should know."""
    from shiftlm.pipeline.actions import Kind, split_keys
    from shiftlm.train.pipeline import build_schedule_for

    actions = [a for rank in build_schedule_for(config).ranks for a in rank]
    forwards = [a for a in actions if a.kind is Kind.F]
    split = split_keys(actions)
    if split:
        log.warning(
            "train.compile: %s splits %d of %d stage forwards' backwards into I + W, and those run "
            "eagerly (their weight gradients wait in Python); 1f1b or interleaved_1f1b keep every block "
            "compiled",
            config.train.schedule,
            len(split),
            len(forwards),
        )


def normalised_loss(
    stage: Transformer, logits: torch.Tensor, targets: torch.Tensor, target_tokens: int
) -> torch.Tensor:
    """Sum of per-token losses over the global target-token count: the global mean's share."""
    return stage.loss(logits, targets).sum() / target_tokens


def sequence_slice(array: np.ndarray, mesh: Mesh) -> torch.Tensor:
    """This rank's tokens of a [batch, seq] array: its zigzag chunks over cp, then its contiguous
    Ulysses slice over sp (the split the model's positions follow, `ring_attention.sequence_indices`)."""
    cp, sp = mesh.cp, mesh.sp
    index = sequence_indices(array.shape[1], cp.size, cp.rank, sp.size, sp.rank)
    return torch.as_tensor(np.ascontiguousarray(array[:, index]), device=mesh.device)


def autocast_dtype(config: TrainConfig, device: torch.device) -> torch.dtype | None:
    """bf16 autocast where asked, or on `auto` on a GPU that has bf16 (fp32 on the CPU); None means
    plain fp32. Parameters, gradients and Adam moments stay fp32 either way (master weights)."""
    dtype = config.train.dtype
    if dtype == "bf16":
        check_dtype(device, torch.bfloat16)
        return torch.bfloat16
    if dtype == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


class StepRunner:
    def __init__(
        self,
        stages: list[Transformer],
        mesh: Mesh,
        config: TrainConfig,
        on_stage_grads_ready: Callable[[tuple[int, int]], None] | None = None,
    ):
        """`on_stage_grads_ready((stage, replica))`: with a pipeline, called when a stage's gradients
        are final (the executor computes them itself, so autograd's accumulate hooks do not fire)."""
        self.stages, self.mesh, self.config = stages, mesh, config
        self.autocast_dtype = autocast_dtype(config, mesh.device)
        self.pipeline = None
        model = stages[0].config
        # the MoE load-balancing loss: coefficient over the step's micro-batches (train/moe.py)
        self.aux_coef = model.router_aux_loss_coef if aux_loss_active(model) else 0.0
        self.micro_batches = config.train.global_batch // config.train.micro_batch
        if mesh.config.pp > 1:
            from shiftlm.train.pipeline import make_executor

            modules, loss = stages, normalised_loss
            if config.data.format == "streams":  # each stage runs its micro-batch's positions and mask
                from shiftlm.train.streams import StreamStage

                modules = [StreamStage(stage) for stage in stages]
            elif self.aux_coef:  # the router statistics travel with the activations
                modules = [RouterStatsStage(stage, config.train.micro_batch) for stage in stages]
                loss = self._pipeline_loss
            self.modules = modules
            self.pipeline = make_executor(modules, mesh, config, loss, on_stage_grads_ready)

    def _aux_share(self, stats: torch.Tensor) -> torch.Tensor:
        return aux_loss_share(stats, self.mesh, self.aux_coef, self.micro_batches)

    def _pipeline_loss(self, module: RouterStatsStage, out: tuple, targets: torch.Tensor, tokens: int):
        logits, stats = out
        return normalised_loss(module.stage, logits, targets, tokens) + self._aux_share(stats)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.mesh.device.type, dtype=self.autocast_dtype)

    def run(self, micro_batches: list[tuple[np.ndarray, np.ndarray]], target_tokens: int) -> torch.Tensor:
        """Forward + backward of every micro-batch; returns this rank's share of the global loss."""
        inputs = [sequence_slice(batch[0], self.mesh) for batch in micro_batches]
        targets = [sequence_slice(batch[1], self.mesh) for batch in micro_batches]
        device = self.mesh.device
        contexts = [stream_context(batch[2], device) if len(batch) > 2 else None for batch in micro_batches]
        with self._autocast():
            if self.pipeline is not None:
                for module in self.modules if contexts and contexts[0] is not None else ():
                    module.contexts = contexts
                return self.pipeline(inputs, targets, target_tokens)
            total = torch.zeros((), device=self.mesh.device)
            stage = self.stages[0]
            for x, y, context in zip(inputs, targets, contexts):
                # no pipeline, no deferred weight gradients: autograd's linears
                positions, backend = (None, None) if context is None else (context.positions, context.backend)
                logits = stage(x, positions, backend, ops=PLAIN)
                loss = normalised_loss(stage, logits, y, target_tokens)
                if self.aux_coef:
                    experts = stage.config.num_experts
                    loss = loss + self._aux_share(router_stats(stage, experts, self.mesh.device))
                loss.backward()
                total += loss.detach().float()
        return total
