"""Atomic, durable training checkpoints: everything goes into a hidden temp dir renamed when complete.

    <log.dir>/checkpoints/step_00000020/
        model/                      HF checkpoint (config.json + safetensors), via the core's saver
        optimizer-00000.safetensors full Adam moments per HF name, one file per pipeline stage
        rng/rank-00000.safetensors  torch / numpy / python (/ CUDA) RNG states of every rank, as tensors
        trainer.json                step, samples consumed, layout, config, data shape; written last

Durability follows the POSIX recipe (as in PostgreSQL and LevelDB): every file of the temp dir is
fsynced, then every directory of it, then the temp dir is renamed into place and its parent fsynced, so a
crash or power loss at any point leaves either the previous checkpoints alone or the new one complete;
half-written `.step_*.tmp` dirs are ignored and removed by the next save.

Nothing in a checkpoint is unpickled: the RNG states are plain tensors in safetensors, and a legacy
`rng/rank-*.pt` is read with `torch.load(weights_only=True)`, which refuses arbitrary objects
(a checkpoint directory is data from wherever it was copied, not code).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from shiftlm.errors import RunDirError
from shiftlm.model.weights import CheckpointError, open_safetensors
from shiftlm.train.config import CheckpointSection

TRAINER_FILE = "trainer.json"
# the settings that decide which tokens step s reads: resuming with any of them changed would shift the data
DATA_SHAPING = (
    ("train", "seq_len"),
    ("train", "global_batch"),
    ("train", "seed"),
    ("data", "source"),
    ("data", "text_key"),
    ("data", "tokenizer"),
    ("data", "vocab_size"),
    ("data", "corpus_mb"),
)
RUN_FILES = ("metrics.jsonl", "loss.png", "tensorboard", "ledgers")  # what a run leaves beside checkpoints/
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


def commit(staging: Path, trainer_state: dict[str, Any], keep: int) -> Path:
    """Write trainer.json, rename the staging dir into place, then drop all but the newest `keep`."""
    final = staging.parent / checkpoint_name(trainer_state["step"])
    with open(staging / TRAINER_FILE, "w") as handle:
        json.dump(trainer_state, handle, indent=2)
    fsync_tree(staging)  # data files, then their directories, before the rename makes them visible
    if os.environ.get(CRASH_BEFORE_COMMIT) == str(trainer_state["step"]):
        os._exit(17)  # simulates a kill after every file is written but before the rename
    if final.exists():  # re-saving a step (a resumed run): swap the old one out
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync(final.parent)
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


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory, deepest first (root last).

    Ranks write into one staging dir at once, so a file listed here may be another rank's temporary file
    that is renamed away before we open it: that rank fsyncs the renamed file itself, and rank 0 walks
    the whole tree again after the barrier, when nothing moves any more.
    """
    directories = []
    for directory, _, files in os.walk(root):
        directories.append(Path(directory))
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                _fsync(Path(directory) / name)
    for directory in sorted(directories, key=lambda p: len(p.parts), reverse=True):
        _fsync(directory)


def rng_tensors() -> dict[str, torch.Tensor]:
    """This process's torch, numpy and python (and CUDA, once used) RNG states as plain host tensors."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    tensors = {
        "torch": torch.get_rng_state(),
        "numpy.keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "numpy.pos_has_gauss": torch.tensor([pos, has_gauss], dtype=torch.int64, device="cpu"),
        "numpy.cached_gaussian": torch.tensor([cached], dtype=torch.float64, device="cpu"),
        "python.internal": torch.tensor(internal, dtype=torch.int64, device="cpu"),
        "python.version": torch.tensor([version], dtype=torch.int64, device="cpu"),
        "python.gauss_next": torch.tensor(
            [0.0 if gauss_next is None else gauss_next, gauss_next is not None],
            dtype=torch.float64,
            device="cpu",
        ),
    }
    if torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{index}"] = state
    return tensors


def set_rng_tensors(tensors: dict[str, torch.Tensor]) -> None:
    """The inverse of `rng_tensors`."""
    torch.set_rng_state(tensors["torch"])
    pos, has_gauss = (int(v) for v in tensors["numpy.pos_has_gauss"])
    keys = tensors["numpy.keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, pos, has_gauss, float(tensors["numpy.cached_gaussian"][0])))
    gauss, has_next = (float(v) for v in tensors["python.gauss_next"])
    internal = tuple(int(v) for v in tensors["python.internal"])
    random.setstate((int(tensors["python.version"][0]), internal, gauss if has_next else None))
    cuda = sorted((k for k in tensors if k.startswith("cuda.")), key=lambda k: int(k.split(".")[1]))
    if cuda and torch.cuda.is_initialized() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])


def rng_file(directory: Path, rank: int) -> Path:
    return directory / "rng" / f"rank-{rank:05d}.safetensors"


def save_rng(directory: Path, rank: int) -> None:
    (directory / "rng").mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in rng_tensors().items()}, rng_file(directory, rank))


def load_rng(directory: Path, rank: int) -> None:
    """Restore this rank's RNG states (only meaningful when resuming into the same layout)."""
    file = rng_file(directory, rank)
    legacy = directory / "rng" / f"rank-{rank:05d}.pt"
    if file.is_file():
        with open_safetensors(file) as handle:
            set_rng_tensors({key: handle.get_tensor(key) for key in handle.keys()})
        return
    if not legacy.is_file():
        raise CheckpointError(
            f"{file} is missing: the checkpoint is incomplete; delete {directory} to resume from an older one"
        )
    try:  # an older shiftlm's pickle: tensors and plain containers only, never arbitrary objects
        state = torch.load(legacy, weights_only=True)
    except Exception as err:  # noqa: BLE001 - any refusal is the same news
        raise CheckpointError(
            f"refused to unpickle {legacy} (it is not plain tensors: {type(err).__name__}); delete "
            f"{directory / 'rng'} to resume without restoring the RNG state"
        ) from None
    torch.set_rng_state(state["torch"])


def previous_run(log_dir: Path) -> list[str]:
    """What another run left in `log_dir` (its checkpoints, metrics), as short descriptions."""
    found = []
    checkpoints = sorted(p.name for p in (log_dir / "checkpoints").glob("step_*") if p.is_dir())
    if checkpoints:
        found.append(f"{len(checkpoints)} checkpoint(s), newest {checkpoints[-1]}")
    if (log_dir / "metrics.jsonl").is_file():
        found.append("metrics.jsonl")
    return found


def clear_run(log_dir: Path) -> None:
    """Delete what a previous run left in `log_dir` (--overwrite); other files are left alone."""
    shutil.rmtree(log_dir / "checkpoints", ignore_errors=True)
    for name in RUN_FILES:
        path = log_dir / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()


def check_fresh_start(log_dir: Path, ckpt: CheckpointSection) -> None:
    """A run that does not resume must not mix with another run's checkpoints and metrics."""
    found = previous_run(log_dir)
    if ckpt.resumes or ckpt.overwrite or not found:
        return
    why, go_on = "checkpoint.resume is false", ", --checkpoint.resume=true to continue it,"
    if not ckpt.enable:
        why, go_on = "checkpoint.enable is false (this run neither resumes nor saves)", ""
    raise RunDirError(
        f"{log_dir} holds another run ({', '.join(found)}) and {why}: pass --overwrite to delete it{go_on} "
        "or choose another --log.dir"
    )


def check_data_shaping(
    checkpoint: Path, state: dict[str, Any], config: dict[str, dict[str, Any]], samples: int | None = None
) -> None:
    """Refuse to resume if the settings that decide which tokens each step reads have changed."""
    saved = state.get("config")
    if not saved:
        return
    changed = [
        (f"{section}.{key}", saved[section][key], config[section][key])
        for section, key in DATA_SHAPING
        if key in saved.get(section, {}) and saved[section][key] != config[section][key]
    ]
    if changed:
        was = ", ".join(f"{name}={old!r} (now {new!r})" for name, old, new in changed)
        keep = " ".join(f"--{name}={old}" for name, old, _ in changed)
        raise RunDirError(
            f"{checkpoint} was trained with {was}; resuming would shift the data each step reads: pass "
            f"{keep} to resume, or start a new run (--overwrite, or another --log.dir)"
        )
    before = state.get("dataset_samples")
    if samples is not None and before is not None and before != samples:
        raise RunDirError(
            f"the dataset now holds {samples} samples but {checkpoint} was trained on {before}: the data "
            "source changed under the same name; restore it, or start a new run (--overwrite, or another --log.dir)"
        )
