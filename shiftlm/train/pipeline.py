"""The trainer's side of pipeline parallelism: which stages this rank holds, and the executor call.

The schedule comes from `shiftlm.pipeline` (`[train] schedule`, `chunks`); the executor runs it over
the pp group and calls `normalised_loss` on the last stage, the same function the no-pipeline path
uses, so the loss is normalised once whatever the schedule.

A rank's stages are keyed (stage, replica). Every schedule has one model replica except BitPipe
(Wu et al. 2024), whose two replicas' copies of a stage live on mirrored pp ranks r and p-1-r,
start from the same weights and have their gradients summed by the executor's GRAD_SYNC, so they
take identical optimizer steps; replica 0 alone is saved and counted in the gradient norm.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shiftlm.errors import ConfigError
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
    return spec.default_chunks if spec.chunks_fixed else config.train.chunks


def build_schedule_for(config: TrainConfig):
    from shiftlm.pipeline.schedules import build_schedule

    try:
        return build_schedule(
            config.train.schedule, config.parallel.pp, config.accumulation, resolved_chunks(config)
        )
    except ValueError as err:
        raise ConfigError(f"{err} (micro-batches per step = global_batch / (micro_batch x dp))") from None


StageKey = tuple[int, int]  # (pipeline stage, model replica)


def stage_keys(config: TrainConfig, mesh: Mesh) -> list[StageKey]:
    """The (stage, replica) pairs (of pp x chunks stages) this rank holds, in the placement's order."""
    if config.parallel.pp == 1:
        return [(0, 0)]
    return build_schedule_for(config).placement.stages_of(mesh.coords.pp)


def make_executor(
    stages: list[Transformer],
    mesh: Mesh,
    config: TrainConfig,
    loss: Callable,
    on_stage_grads_ready: Callable[[StageKey], None] | None = None,
) -> Callable:
    """A function (inputs, targets, target_tokens) -> this rank's loss share, running the schedule.

    `on_stage_grads_ready(key)` is passed to the executor: called once a stage's gradients are final. The executor is `run.executor`.
    """
    from shiftlm.pipeline.executor import PipelineExecutor

    modules = dict(zip(stage_keys(config, mesh), stages))
    last = modules[max(modules)]  # the loss only needs the TP layout and vocab slice: any stage has them

    def loss_fn(logits: torch.Tensor, target: tuple[torch.Tensor, int]) -> torch.Tensor:
        targets, target_tokens = target
        return loss(last, logits, targets, target_tokens)

    executor = PipelineExecutor(
        build_schedule_for(config),
        modules,
        rank=mesh.coords.pp,
        pp_group=mesh.pp,
        pp_ranks=list(mesh.pp.ranks),
        loss_fn=loss_fn,
        on_stage_grads_ready=on_stage_grads_ready,
        device=mesh.device,
    )

    def run(inputs: list[torch.Tensor], targets: list[torch.Tensor], target_tokens: int) -> torch.Tensor:
        result = executor.step(inputs, [(y, target_tokens) for y in targets])
        return torch.zeros((), device=mesh.device) if result is None else result.float()

    run.executor = executor
    return run
