"""`shiftlm export --to-hf DIR`: a training checkpoint's model as a standalone HF model directory.

Checkpoints already keep the model in HF format with the tokenizer beside it (`<ckpt>/model`), so
exporting is a verified copy, written atomically (temp dir, then rename) so DIR is never half there.
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
        raise CheckpointError(f"checkpoint {source} does not exist")
    read_trainer_state(source)  # refuses incomplete or corrupt checkpoints
    model = source / "model"
    if not (model / "config.json").is_file():
        raise CheckpointError(f"{model} has no config.json: the checkpoint is incomplete")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        shutil.copytree(model, staging, dirs_exist_ok=True)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
