"""Atomic training checkpoints: everything goes into a hidden temp dir that is renamed when complete.

    <log.dir>/checkpoints/step_00000020/
        model/                      HF checkpoint (config.json + safetensors), via the core's saver
        optimizer-00000.safetensors full Adam moments per HF name, one file per pipeline stage
        rng/rank-00000.pt           torch / numpy / python RNG states of every rank
        trainer.json                step, samples consumed, layout, config; written last

A rename is atomic on POSIX, so a crash at any point leaves either the previous checkpoints alone
or the new one complete; half-written `.step_*.tmp` dirs are ignored and removed by the next save.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shiftlm.model.weights import CheckpointError

TRAINER_FILE = "trainer.json"
CRASH_BEFORE_COMMIT = "SHIFTLM_CRASH_BEFORE_COMMIT"  # tests: exit at this step before the rename


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def staging_dir(root: Path, step: int) -> Path:
    return root / f".{checkpoint_name(step)}.tmp"


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under `root` (temp dirs of interrupted saves are skipped)."""
    if not root.is_dir():
        return None
    complete = sorted(p for p in root.glob("step_*") if p.is_dir())
    return complete[-1] if complete else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(staging: Path, trainer_state: dict[str, Any], keep: int) -> Path:
    """Write trainer.json, rename the staging dir into place, then drop all but the newest `keep`."""
    final = staging.parent / checkpoint_name(trainer_state["step"])
    with open(staging / TRAINER_FILE, "w") as handle:
        json.dump(trainer_state, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    if os.environ.get(CRASH_BEFORE_COMMIT) == str(trainer_state["step"]):
        os._exit(17)  # simulates a kill after every file is written but before the rename
    if final.exists():  # re-saving a step (a resumed run): swap the old one out
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_dir(final.parent)
    for old in sorted(p for p in final.parent.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in final.parent.glob(".step_*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    return final


def read_trainer_state(checkpoint: Path) -> dict[str, Any]:
    """trainer.json of a checkpoint, with an error that names the problem if it is missing or corrupt."""
    file = checkpoint / TRAINER_FILE
    if not file.is_file():
        raise CheckpointError(
            f"{checkpoint} is not a complete checkpoint ({TRAINER_FILE} is missing); delete it"
        )
    try:
        state = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(
            f"{file} is corrupt ({err}); delete {checkpoint} to resume from an older one"
        ) from None
    for key in ("step", "samples", "optimizer_step", "layout"):
        if key not in state:
            raise CheckpointError(f"{file} lacks '{key}'; it was not written by shiftlm train")
    return state


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def save_rng(directory: Path, rank: int) -> None:
    (directory / "rng").mkdir(exist_ok=True)
    torch.save(rng_state(), directory / "rng" / f"rank-{rank:05d}.pt")


def load_rng(directory: Path, rank: int) -> None:
    """Restore this rank's RNG states (only meaningful when resuming into the same layout)."""
    state = torch.load(directory / "rng" / f"rank-{rank:05d}.pt", weights_only=False)
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
