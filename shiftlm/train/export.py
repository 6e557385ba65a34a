"""`shiftlm export --to-hf DIR`: a training checkpoint's model as a standalone HF model directory.

Checkpoints already keep the model in HF format with the tokenizer beside it (`<ckpt>/model`), so
exporting is a verified copy plus the `generation_config.json` that `transformers` would write beside
its own checkpoints (so `transformers` and vLLM load it without warnings), written atomically (temp
dir, then rename) so DIR is never half there.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from shiftlm.model.weights import CheckpointError
from shiftlm.train.checkpoint import latest_checkpoint, read_trainer_state


def export_checkpoint(run_dir: Path, out: Path, checkpoint: str | None = None) -> Path:
    """Copy `checkpoint` (default: the run's newest) model dir to `out`; returns `out`."""
    source = Path(checkpoint) if checkpoint else latest_checkpoint(run_dir / "checkpoints")
    if source is None:
        raise CheckpointError(
            f"no checkpoint under {run_dir / 'checkpoints'}: train first, or pass --checkpoint"
        )
    if not source.is_dir():
        what = "is a file, not a checkpoint directory" if source.exists() else "does not exist"
        raise CheckpointError(f"checkpoint {source} {what}: pass a step_* directory of a run's checkpoints/")
    read_trainer_state(source)  # refuses incomplete or corrupt checkpoints
    model = source / "model"
    if not (model / "config.json").is_file():
        raise CheckpointError(f"{model} has no config.json: the checkpoint is incomplete")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        shutil.copytree(model, staging, dirs_exist_ok=True)
        write_generation_config(staging)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def write_generation_config(model_dir: Path) -> None:
    """`generation_config.json` as `save_pretrained` writes it: the config's bos/eos ids, and the
    tokenizer's pad id where it has one (else the eos id, which `generate` would pick with a warning)."""
    from transformers import AutoConfig, GenerationConfig

    generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_dir))
    if generation.pad_token_id is None:
        generation.pad_token_id = _tokenizer_pad_id(model_dir)
        if generation.pad_token_id is None:
            eos = generation.eos_token_id
            generation.pad_token_id = eos[0] if isinstance(eos, list) else eos
    generation.save_pretrained(model_dir)


def _tokenizer_pad_id(model_dir: Path) -> int | None:
    if not (model_dir / "tokenizer.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).pad_token_id
