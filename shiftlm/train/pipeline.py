"""The trainer's side of pipeline parallelism: which stages this rank holds, and the executor call.

The schedule comes from `shiftlm.pipeline` (`[train] schedule`, `chunks`); the executor runs it over
the pp group and calls `normalised_loss` on the last stage, the same function the no-pipeline path
uses, so the loss is normalised once whatever the schedule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shiftlm.config import ConfigError
from shiftlm.mesh import Mesh
from shiftlm.model import Transformer
from shiftlm.train.config import TrainConfig


def resolved_chunks(config: TrainConfig) -> int:
    """Stages per rank: fixed by V-shaped schedules (2), else `train.chunks`."""
    if config.parallel.pp == 1:
        return 1
    from shiftlm.pipeline.schedules import SCHEDULES

    spec = SCHEDULES.get(config.train.schedule)
    if spec is None:
        raise ConfigError(f"train.schedule = {config.train.schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if config.train.schedule == "bitpipe":
        raise ConfigError("train does not run bitpipe (two model replicas) yet; use zb_v or 1f1b")
    return spec.default_chunks if spec.chunks_fixed else config.train.chunks


def build_schedule_for(config: TrainConfig):
    from shiftlm.pipeline.schedules import build_schedule

    try:
        return build_schedule(
            config.train.schedule, config.parallel.pp, config.accumulation, resolved_chunks(config)
        )
    except ValueError as err:
        raise ConfigError(f"{err} (micro-batches per step = global_batch / (micro_batch x dp))") from None


def stage_indices(config: TrainConfig, mesh: Mesh) -> list[int]:
    """The pipeline stages (of pp x chunks) this rank holds, in order."""
    placement = build_schedule_for(config).placement
    return [stage for stage, _ in placement.stages_of(mesh.coords.pp)]


def make_executor(stages: list[Transformer], mesh: Mesh, config: TrainConfig, loss: Callable) -> Callable:
    """A function (inputs, targets, target_tokens) -> this rank's loss share, running the schedule."""
    from shiftlm.pipeline.executor import PipelineExecutor

    indices = stage_indices(config, mesh)
    last = {index: stage for index, stage in zip(indices, stages)}

    def loss_fn(logits: torch.Tensor, target: tuple[torch.Tensor, int]) -> torch.Tensor:
        targets, target_tokens = target
        return loss(last[max(last)], logits, targets, target_tokens)

    executor = PipelineExecutor(
        build_schedule_for(config),
        dict(zip(indices, stages)),
        rank=mesh.coords.pp,
        pp_group=mesh.pp.pg,
        pp_ranks=list(mesh.pp.ranks),
        loss_fn=loss_fn,
    )

    def run(inputs: list[torch.Tensor], targets: list[torch.Tensor], target_tokens: int) -> torch.Tensor:
        result = executor.step(inputs, [(y, target_tokens) for y in targets])
        return torch.zeros(()) if result is None else result.float()

    return run
