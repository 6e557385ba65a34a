"""Checks `shiftlm train` runs before it starts a rank: layout vs world, run dir, and memory.

The memory estimate is the simulator's model (`shiftlm.sim.memory.estimate_memory`: Rajbhandari et al.
2020 for the weights, gradients and Adam state; Korthikanti et al. 2022 for the activations; the
in-flight micro-batches of the real pipeline schedule), with the trainer's own states in place of
mixed-precision Megatron's 2 + 2 + 12 bytes (`shiftlm.sim.trainer_costs`: fp32 weights, sharded at
ZeRO-3; the full fp32 gradient buffer and grad-norm mask at every stage; Adam moments and the decay
mask sharded from ZeRO-1); the planner checks its plans with the same function. On a GPU each rank has
the device's memory; on the CPU every local rank shares the machine's available RAM, so the estimate is
per rank x ranks on this machine. A run that cannot fit is refused with the numbers before any work.
"""

from __future__ import annotations

import os
from pathlib import Path

from shiftlm.config import ModelConfig
from shiftlm.errors import ConfigError, DoesNotFitError
from shiftlm.hardware import GIB
from shiftlm.train.config import TrainConfig

CPU_RUNTIME_BYTES = 0.4 * GIB  # Python + torch of one CPU rank (measured: ~0.35 GB RSS before the model)


def check_world(config: TrainConfig, nproc: int) -> None:
    """`--nproc` (or torchrun's WORLD_SIZE) must start exactly the ranks the layout needs."""
    p = config.parallel
    needed = p.world_size
    layout = f"dp*pp*cp*sp*tp = {p.dp}*{p.pp}*{p.cp}*{p.sp}*{p.tp} = {needed}"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if nproc > 1:
            raise ConfigError(
                "--nproc starts local workers; under torchrun leave it out (torchrun starts them)"
            )
        return  # the trainer checks WORLD_SIZE against the layout, with the fix
    if nproc != needed:
        raise ConfigError(
            f"the layout needs {needed} ranks ({layout}) but --nproc is {nproc}: "
            f"use --nproc {needed} (or torchrun --nproc-per-node {needed}), or change the layout"
        )


def fill_dp(config: TrainConfig, nproc: int, dp_given: bool) -> tuple[TrainConfig, str]:
    """As torchtitan's `data_parallel_shard_degree = -1`: with dp not given, the ranks the rest of the
    layout does not use (`--nproc`, or torchrun's WORLD_SIZE) become data parallelism. Returns the
    config and the line that says so ("" when nothing changed)."""
    import dataclasses

    from shiftlm.train.config import validate

    world = max(nproc, int(os.environ.get("WORLD_SIZE", "1")))
    p = config.parallel
    inner = p.pp * p.cp * p.sp * p.tp
    if dp_given or world == p.world_size or world % inner:
        return config, ""
    filled = dataclasses.replace(config, parallel=dataclasses.replace(p, dp=world // inner))
    validate(filled)
    return filled, (
        f"{world} ranks, pp*cp*sp*tp = {inner}: the other ranks are data parallel, dp = {world // inner} "
        "(--parallel.dp sets it)"
    )


def run_device(config: TrainConfig, nproc: int):
    """The device the ranks will run on (`--nproc` starts local gloo, CPU, ranks)."""
    import torch

    from shiftlm.mesh import choose_device

    return choose_device(config.train.device)[0] if nproc <= 1 else torch.device("cpu")


def check_run_dir(config: TrainConfig) -> None:
    """The run-dir checks the trainer repeats, done first so that a refusal costs no worker start."""
    from shiftlm.train.checkpoint import (
        check_data_shaping,
        check_fresh_start,
        latest_checkpoint,
        read_trainer_state,
    )

    log_dir, ckpt = Path(config.log.dir), config.checkpoint
    check_fresh_start(log_dir, ckpt)
    latest = latest_checkpoint(log_dir / "checkpoints") if ckpt.resumes else None
    if latest is not None:
        check_data_shaping(latest, read_trainer_state(latest), config.to_dict())


def _available_bytes(device) -> tuple[float, str, int]:
    """(bytes one rank may use, a description of the device, local ranks sharing it)."""
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return float(props.total_memory), f"one {props.name}", 1
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return float(available), "this machine's available RAM", 0


def estimate(config: TrainConfig, model: ModelConfig, nproc: int, on_gpu: bool = False) -> dict:
    """Bytes per rank by kind, the total over the ranks sharing one memory, and that memory.
    `on_gpu`: as one rank of a GPU run (bf16 activations unless train.dtype = fp32, the GPU runtime
    reserve), whatever this machine is: what `--dry-run` reports for a cluster's plan."""
    from shiftlm.sim.layout import Layout
    from shiftlm.sim.trainer_costs import trainer_memory
    from shiftlm.train.pipeline import resolved_chunks
    from shiftlm.train.step import autocast_dtype

    p, t = config.parallel, config.train
    chunks = resolved_chunks(config)
    layout = Layout(
        dp=p.dp,
        pp=p.pp,
        tp=p.tp,
        sp=p.sp,
        micro_batch=t.micro_batch,
        global_batch=t.global_batch,
        seq_len=t.seq_len,
        schedule=t.schedule,
        chunks=chunks,
        recompute=t.recompute,
        zero=min(t.zero, 3),
        cp=p.cp,
        ep=p.ep,
        etp=p.etp,
        sequence_parallel=p.sequence_parallel,
        flash_attention=True,  # PyTorch SDPA's fused causal path keeps no s x s scores
    )
    in_flight = 1
    if p.pp > 1:
        from shiftlm.pipeline.peak import peak_in_flight

        try:
            in_flight = peak_in_flight(t.schedule, p.pp, layout.microbatches, chunks)
        except Exception:  # noqa: BLE001 - a schedule the simulator does not build: assume all in flight
            in_flight = layout.microbatches * chunks
    engine_device = run_device(config, nproc)
    capacity, device, sharing = _available_bytes(engine_device)
    activation_bytes = 2 if autocast_dtype(config, engine_device) is not None else 4
    if on_gpu and not sharing:
        capacity, device, sharing = float("inf"), "a GPU (none here)", 1
        activation_bytes = 4 if t.dtype == "fp32" else 2
    reserve = None if sharing else CPU_RUNTIME_BYTES
    memory = trainer_memory(model, layout, in_flight, capacity, activation_bytes, reserve, t.loss_chunk)
    ranks = sharing or max(nproc, 1)
    return {
        "per_rank_gib": {k: v for k, v in memory.as_dict().items() if k not in ("capacity", "fits")},
        "tensor_bytes": memory.total - memory.reserve,  # unrounded, without the runtime reserve
        "ranks_sharing": ranks,
        "total_gib": round(ranks * memory.total / GIB, 2),
        "available_gib": round(capacity / GIB, 2),
        "device": device,
        "fits": ranks * memory.total <= capacity,
    }


def check_memory(config: TrainConfig, model: ModelConfig, nproc: int) -> dict:
    """Refuse (DoesNotFitError, with the numbers) a run whose estimate exceeds this device."""
    result = estimate(config, model, nproc)
    if not result["fits"]:
        per = result["per_rank_gib"]
        parts = ", ".join(
            f"{k} {per[k]}" for k in ("weights", "gradients", "optimizer", "activations", "reserve")
        )
        raise DoesNotFitError(
            f"{config.model.name} needs ~{result['total_gib']} GiB ({result['ranks_sharing']} rank(s) x "
            f"{per['total']} GiB: {parts}) but {result['device']} has {result['available_gib']} GiB: use a "
            "smaller model, shard it over more devices (pp, tp; zero=1 with dp shards Adam), lower "
            "train.micro_batch or use train.recompute=full; --skip-memory-check runs it anyway"
        )
    return result
