"""The model: Megatron parallel layers, Ulysses attention, the Llama-family decoder, HF weights in/out."""

from __future__ import annotations

from pathlib import Path

import torch

from shiftlm.config import ModelConfig
from shiftlm.mesh import Mesh
from shiftlm.model.transformer import Transformer, stage_layers


def build_model(
    config: ModelConfig,
    mesh: Mesh | None = None,
    checkpoint: str | Path | None = None,
    seed: int = 0,
    layers: tuple[int, int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Transformer:
    """This rank's part of the model: its pipeline stage (by default from the mesh) and TP shard.

    Weights come from a HF checkpoint directory, or from a seeded init that is the same in every layout.
    The parameters are made in `dtype` (no fp32 copy that is then cast).
    """
    from shiftlm.model.weights import init_weights, load_hf_checkpoint

    if layers is None and mesh is not None:
        layers = stage_layers(config.num_layers, mesh.config.pp, mesh.coords.pp)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype.is_floating_point else default)
    try:
        model = Transformer(config, mesh, layers)
    finally:
        torch.set_default_dtype(default)
    if checkpoint is not None:
        load_hf_checkpoint(model, checkpoint)
    else:
        init_weights(model, seed)
    return model.to(dtype)


__all__ = ["Transformer", "build_model", "stage_layers"]
