"""Weights in and out: seeded layout-independent init, HF safetensors straight into a layout, and back.

Every rank reads only its own slices (`safe_open(...).get_slice`), never the whole model. Saving
gathers each tensor over the TP group; the (dp=0, sp=0, tp=0) rank of every pipeline stage writes that
stage's file, global rank 0 writes `config.json` and the index. The directory appears atomically:
everything is written into a temporary sibling that is renamed into place at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from shiftlm.comm import all_gather, all_reduce
from shiftlm.errors import CheckpointError
from shiftlm.model.sharding import ShardSpec, full_shape, is_expert_param, shard_spec
from shiftlm.model.transformer import Transformer


def open_safetensors(file: Path, device: torch.device | str = "cpu"):
    """`safe_open(file)` reading tensors onto `device`, with a truncated or corrupt file named as a
    `CheckpointError`."""
    try:
        return safe_open(file, framework="pt", device=str(device))
    except FileNotFoundError:
        raise CheckpointError(f"{file} does not exist: the checkpoint is incomplete") from None
    except Exception as err:  # safetensors raises its own SafetensorError (not an OSError)
        raise CheckpointError(
            f"{file} is truncated or corrupt ({err}): copy or export the checkpoint again"
        ) from None


def check_checkpoint_files(path: Path) -> None:
    """Open every safetensors file of an HF checkpoint dir once (header and size), before any work."""
    for file in sorted(set(_tensor_files(Path(path)).values())):
        open_safetensors(file)


def source_name(model: Transformer, name: str) -> str:
    """The checkpoint tensor a parameter comes from (a tied head reads the embedding)."""
    if name == "lm_head.weight" and model.config.tie_word_embeddings:
        return "model.embed_tokens.weight"
    return name


def shard_group(mesh, name: str):
    """The group that splits tensor `name`: `etp` for a routed expert's (its own expert TP), else `tp`."""
    return mesh.etp if is_expert_param(name) else mesh.tp


def local_spec(model: Transformer, source: str) -> ShardSpec:
    """This rank's slice of checkpoint tensor `source`, over the group that splits it."""
    group = shard_group(model.mesh, source)
    return shard_spec(source, model.config, group.rank, group.size)


def take_shard(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """This rank's slice of a full tensor, per its spec (padding rows are zero)."""
    if spec.dim is None:
        return full
    parts = [full.narrow(spec.dim, a, b - a) for a, b in spec.ranges]
    if spec.pad:
        shape = list(full.shape)
        shape[spec.dim] = spec.pad
        parts.append(full.new_zeros(shape))
    return torch.cat(parts, dim=spec.dim)


def place_shard(full: torch.Tensor, shard: torch.Tensor, spec: ShardSpec) -> None:
    """Write a shard back into its rows of the full tensor; padding rows are dropped."""
    if spec.dim is None:
        full.copy_(shard)
        return
    offset = 0
    for a, b in spec.ranges:
        full.narrow(spec.dim, a, b - a).copy_(shard.narrow(spec.dim, offset, b - a))
        offset += b - a


@torch.no_grad()
def init_weights(model: Transformer, seed: int = 0) -> None:
    """Seeded full-size init, then slice: identical weights in every layout (one generator per tensor).

    Each full tensor is drawn on the CPU (CPU and CUDA generators draw different numbers, so the
    weights are also the same on every device); only this rank's slice is copied to its device."""
    for name, param in model.named_parameters():
        source = source_name(model, name)
        shape = full_shape(source, model.config)
        if source.endswith("norm.weight"):  # layer, final and qwen3's q/k norms
            full = torch.ones(shape, device="cpu")
        elif source.endswith(".bias"):
            full = torch.zeros(shape, device="cpu")
        else:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(source.encode()))
            full = torch.empty(shape, device="cpu").normal_(
                0.0, model.config.initializer_range, generator=generator
            )
        param.copy_(take_shard(full, local_spec(model, source)))


def _tensor_files(path: Path) -> dict[str, Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(
                f"{index} is corrupt ({err!r}): copy or export the checkpoint again"
            ) from None
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise CheckpointError(
            f"no model.safetensors or model.safetensors.index.json in {path}: "
            "save the checkpoint with save_pretrained(..., safe_serialization=True)"
        )
    with open_safetensors(single) as f:
        return {name: single for name in f.keys()}


@torch.no_grad()
def load_hf_checkpoint(model: Transformer, path: str | Path) -> None:
    """Fill this rank's shards from a HF checkpoint directory, reading only those slices, straight
    onto the model's device (no full-model copy in host memory)."""
    path = Path(path)
    files = _tensor_files(path)
    opened: dict[Path, object] = {}
    try:
        for name, param in model.named_parameters():
            source = source_name(model, name)
            if source not in files:
                raise CheckpointError(
                    f"checkpoint {path} is missing tensor {source!r} (expected shape "
                    f"{list(full_shape(source, model.config))}): is it a {model.config.model_type} checkpoint "
                    "matching config.json?"
                )
            file = files[source]
            handle = opened.get(file) or opened.setdefault(file, open_safetensors(file))
            tensor_slice = handle.get_slice(source)
            expected = list(full_shape(source, model.config))
            if list(tensor_slice.get_shape()) != expected:
                raise CheckpointError(
                    f"tensor {source!r} in {file.name} has shape {list(tensor_slice.get_shape())} but "
                    f"config.json implies {expected}: the weights and config.json do not belong together"
                )
            spec = local_spec(model, source)
            param.copy_(_read_shard(tensor_slice, spec, expected, param.dtype, param.device))
    finally:
        opened.clear()


def _read_shard(
    tensor_slice, spec: ShardSpec, shape: list[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """This rank's rows of one checkpoint tensor on `device`: each slice is read from the memory-mapped
    file and moved on its own (safetensors builds a slice with torch's default device, hence the
    explicit host scope), so no more than one tensor's shard is ever staged in host memory."""
    with torch.device("cpu"):
        if spec.dim is None:
            parts = [tensor_slice[:]]
        else:
            parts = [tensor_slice[a:b] if spec.dim == 0 else tensor_slice[:, a:b] for a, b in spec.ranges]
    parts = [part.to(device=device, dtype=dtype) for part in parts]
    if spec.pad:
        pad_shape = list(shape)
        pad_shape[spec.dim] = spec.pad
        parts.append(torch.zeros(pad_shape, dtype=dtype, device=device))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=spec.dim)


@torch.no_grad()
def gather_to_full(model: Transformer, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full HF-shaped tensors from this rank's shards (keyed by parameter name; collective over TP,
    and over `etp` for routed experts).

    Works for anything sharded like the parameters: weights, gradients, optimizer moments.
    """
    out = {}
    for name, shard in local.items():
        source = source_name(model, name)
        group = shard_group(model.mesh, source)
        shards = all_gather(shard.detach().unsqueeze(0), group, dim=0)
        full = torch.zeros(full_shape(source, model.config), dtype=shard.dtype, device=shard.device)
        for rank in range(group.size):
            place_shard(full, shards[rank], shard_spec(source, model.config, rank, group.size))
        out[name] = full
    return out


def gather_full(model: Transformer, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full HF-shaped tensors of this stage's parameters (or gradients).

    For gradients, call `sync_tp_replicated_grads` first; they are then summed over the dp_sp group
    (Ulysses splits tokens), so the result equals the gradient of the single-rank model on the whole
    batch when the loss is normalised globally. A tied head next to its embedding is left out.
    """
    local = {}
    for name, param in model.named_parameters():
        if name == "lm_head.weight" and source_name(model, name) != name and model.with_embedding:
            continue
        tensor = param.grad if grads else param
        local[name] = torch.zeros_like(param) if tensor is None else tensor
    out = gather_to_full(model, local)
    if grads:  # an expert's replicas are the ranks holding the same experts (`edp`), not all of dp_sp
        mesh = model.mesh
        out = {
            name: all_reduce(t, mesh.edp if is_expert_param(name) else mesh.dp_sp) for name, t in out.items()
        }
    return out


def write_hf_files(stages: list[Transformer], directory: Path) -> None:
    """Write this rank's stages into `directory` in HF format (collective; not atomic by itself).

    One safetensors file per pipeline rank (per pipeline and ep rank with expert parallelism), written by
    its (dp=0, cp=0, sp=0, tp=0) rank and, for experts, by the ep ranks of expert replica 0 (etp rank 0); global rank 0
    writes `config.json` and, with several files, the index. A rank may hold several stages
    (interleaved and V schedules).
    """
    mesh = stages[0].mesh
    distributed = dist.is_available() and dist.is_initialized() and mesh.world_size > 1
    # a tied head's copy on the last stage is not a checkpoint tensor: the embedding is saved by stage 0
    tensors = {n: t for stage in stages for n, t in gather_full(stage).items() if source_name(stage, n) == n}
    c, pp, ep = mesh.coords, mesh.config.pp, mesh.config.ep
    # with expert parallelism each ep rank of the first expert replica (edp rank 0) writes its experts,
    # ep rank 0 the rest: one file per (pp, ep) rank
    files, part = pp * ep, c.pp * ep + mesh.ep_rank
    file = "model.safetensors" if files == 1 else f"model-{part + 1:05d}-of-{files:05d}.safetensors"
    token_writer = c.dp == 0 and c.cp == 0 and c.sp == 0 and c.tp == 0
    expert_writer = mesh.etp.rank == 0 and mesh.edp.rank == 0
    tensors = {n: t for n, t in tensors.items() if (expert_writer if is_expert_param(n) else token_writer)}
    directory.mkdir(parents=True, exist_ok=True)
    if tensors:
        save_file(
            {k: v.contiguous().cpu() for k, v in tensors.items()}, directory / file, metadata={"format": "pt"}
        )
    names = [(name, file) for name in tensors]
    if distributed:
        gathered: list = [None] * mesh.world_size
        dist.all_gather_object(gathered, names)
        names = [item for part in gathered for item in part]
    if mesh.rank == 0:
        (directory / "config.json").write_text(json.dumps(stages[0].config.to_hf_dict(), indent=2))
        if files > 1:
            index = {"metadata": {}, "weight_map": dict(sorted(names))}
            (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def save_hf_checkpoint(model: Transformer | list[Transformer], path: str | Path) -> None:
    """Write the model (all ranks call it) as a HF checkpoint directory, atomically.

    Everything goes into a staging sibling that replaces `path` only once complete.
    """
    stages = model if isinstance(model, list) else [model]
    mesh = stages[0].mesh
    distributed = dist.is_available() and dist.is_initialized() and mesh.world_size > 1
    path = Path(path)
    staging = path.parent / f".{path.name}.tmp"
    if mesh.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    if distributed:
        dist.barrier()
    write_hf_files(stages, staging)
    if distributed:
        dist.barrier()
    if mesh.rank == 0:
        _replace_dir(staging, path)
    if distributed:
        dist.barrier()


def _replace_dir(staging: Path, path: Path) -> None:
    """Swap `staging` into `path`; an existing directory is kept until the new one is in place."""
    old = path.parent / f".{path.name}.old"
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(staging, path)
    shutil.rmtree(old, ignore_errors=True)
