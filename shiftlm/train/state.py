"""Layout-free training state: full Hugging Face-named tensors in, this rank's shards out.

The model goes through the core's HF save/load (`shiftlm.model.weights`). Adam moments use the
same tensor-parallel plan (`shard_spec`), so a checkpoint written at tp=2, pp=2 loads at dp=2, sp=2:
every moment is stored whole under its parameter's HF name, one file per pipeline stage, and each
rank of the new layout cuts its own slice.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from shiftlm.model.sharding import is_expert_param
from shiftlm.model.transformer import Transformer
from shiftlm.model.weights import (
    CheckpointError,
    gather_to_full,
    local_spec,
    open_safetensors,
    source_name,
    take_shard,
)

MOMENTS = ("exp_avg", "exp_avg_sq")


def _stored_name(model: Transformer, name: str) -> str | None:
    """The HF name a parameter's state is stored under; None for a tied head's copy of the embedding
    (its gradients, hence its moments, equal the embedding's, which stage 0 stores)."""
    return name if source_name(model, name) == name else None


def gather_moments(
    model: Transformer, moments: dict[str, dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Full HF-shaped moments of this stage, keyed `exp_avg.<hf name>` (collective over the TP group)."""
    out = {}
    for moment in MOMENTS:
        local = {n: t for n, t in moments[moment].items() if _stored_name(model, n) is not None}
        out.update({f"{moment}.{n}": t for n, t in gather_to_full(model, local).items()})
    return out


def save_moments(
    stages: list[Transformer], moments: dict[str, dict[str, torch.Tensor]], directory: Path
) -> None:
    """Write this rank's stages' full moments; one writer per pp rank (dp = sp = tp = 0), and with
    ep > 1 (or etp != tp) one per (pp, ep) rank for the routed experts. Collective over TP (and etp)."""
    full = {}
    for stage in stages:
        names = {name for name, _ in stage.named_parameters()}
        mine = {
            moment: {n: t for n, t in by_name.items() if n in names} for moment, by_name in moments.items()
        }
        full.update(gather_moments(stage, mine))
    mesh = stages[0].mesh
    c = mesh.coords
    writes = {f"optimizer-{c.pp:05d}.safetensors": c.dp == 0 and c.cp == 0 and c.sp == 0 and c.tp == 0}
    parts = {name: {k: v for k, v in full.items() if not is_expert_param(k)} for name in writes}
    if (
        mesh.config.experts_apart
    ):  # each ep rank of the first expert replica writes its experts' (as the weights)
        name = f"optimizer-{c.pp:05d}-ep{mesh.ep_rank:03d}.safetensors"
        writes[name] = mesh.etp.rank == 0 and mesh.edp.rank == 0
        parts[name] = {k: v for k, v in full.items() if is_expert_param(k)}
    else:
        parts = {name: full for name in writes}
    for name, write in writes.items():
        if write and parts[name]:
            save_file({k: v.contiguous().cpu() for k, v in parts[name].items()}, directory / name)


@torch.no_grad()
def load_moments(stages: list[Transformer], directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's shards of the moments stored in `directory` (any layout wrote them)."""
    files = sorted(directory.glob("optimizer-*.safetensors"))
    if not files:
        raise CheckpointError(f"no optimizer-*.safetensors in {directory}: the checkpoint is incomplete")
    where: dict[str, Path] = {}
    for file in files:
        with open_safetensors(file) as handle:
            where.update({key: file for key in handle.keys()})
    out: dict[str, dict[str, torch.Tensor]] = {moment: {} for moment in MOMENTS}
    named = [(model, name, param) for model in stages for name, param in model.named_parameters()]
    for moment in MOMENTS:
        for model, name, param in named:
            source = source_name(model, name)
            # a tied head's moments equal its embedding's (their gradients are summed), so either serves
            key = next((k for k in (f"{moment}.{name}", f"{moment}.{source}") if k in where), None)
            if key is None:
                raise CheckpointError(f"checkpoint {directory} has no optimizer state for {name!r}")
            with open_safetensors(where[key], param.device) as handle:
                full = handle.get_tensor(key)
            out[moment][name] = take_shard(full, local_spec(model, source)).to(param.dtype)
    return out
