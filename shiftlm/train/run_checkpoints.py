"""The trainer's checkpoints: save a step atomically, start fresh in a run directory, resume from
its newest checkpoint (`Trainer` inherits these; the file format itself is `train/checkpoint.py`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from shiftlm.model.weights import load_hf_checkpoint, write_hf_files
from shiftlm.train.checkpoint import (
    check_data_shaping,
    check_fresh_start,
    clear_run,
    commit,
    fsync_tree,
    latest_checkpoint,
    load_rng,
    read_trainer_state,
    save_rng,
    staging_dir,
)
from shiftlm.train.state import MOMENTS, load_moments, save_moments
from shiftlm.train.tokenizer import copy_tokenizer


def flat_name(name: str, replica: int) -> str:
    """A parameter's name in the flat buffers: its HF name, prefixed for BitPipe's second replica
    (whose copy of a stage may sit on the same rank as the first's when pp is odd)."""
    return name if replica == 0 else f"replica{replica}.{name}"


def barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class RunCheckpoints:
    """Checkpoint methods of `Trainer` (they read its mesh, config, optimizer, stages and replicas)."""

    def save(self, step: int) -> Path | None:
        """Write a checkpoint after `step` steps (collective); returns its path on rank 0."""
        staging = staging_dir(self.checkpoints, step)
        if self.mesh.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        barrier()
        with self.optimizer.gathered():  # ZeRO-3: every layer present while it is written
            write_hf_files(self.replicas[0], staging / "model")  # BitPipe: one copy, replica 0's
            save_moments(self.replicas[0], self.optimizer.full_state(), staging)
        save_rng(staging, self.mesh.rank)
        fsync_tree(staging)  # each rank makes what it wrote durable (rank 0 again before the rename)
        barrier()
        final = None
        if self.mesh.rank == 0:
            copy_tokenizer(self.inputs.tokenizer_dir, staging / "model")
            state = {
                "step": step,
                "samples": step * self.config.train.global_batch,
                "optimizer_step": self.optimizer.step_count,
                "layout": self.config.to_dict()["parallel"],
                "config": self.config.to_dict(),
                "dataset_samples": self.dataset_samples,
            }
            final = commit(staging, state, self.config.checkpoint.keep)
        barrier()
        return final

    def prepare_run_dir(self) -> None:
        """A fresh start (resume = false) into a used log.dir: refused, or (overwrite) the old run deleted."""
        ckpt = self.config.checkpoint
        log_dir = Path(self.config.log.dir)
        check_fresh_start(log_dir, ckpt)  # same answer on every rank
        if not ckpt.resumes and ckpt.overwrite:
            barrier()
            if self.mesh.rank == 0:
                clear_run(log_dir)
            barrier()

    def maybe_resume(self) -> Path | None:
        """Load the newest checkpoint of log.dir if asked; returns its path (None: a fresh start)."""
        latest = latest_checkpoint(self.checkpoints) if self.config.checkpoint.resumes else None
        if latest is None:
            return None
        state = read_trainer_state(latest)
        check_data_shaping(latest, state, self.config.to_dict(), self.dataset_samples)
        with self.optimizer.gathered(write_back=True):  # ZeRO-3: load full layers, keep the shards
            for stage in self.stages:
                load_hf_checkpoint(stage, latest / "model")
        moments: dict[str, dict[str, torch.Tensor]] = {moment: {} for moment in MOMENTS}
        for replica, stages in enumerate(self.replicas):  # every replica starts from the one saved copy
            for moment, tensors in load_moments(stages, latest).items():
                moments[moment].update({flat_name(name, replica): t for name, t in tensors.items()})
        self.optimizer.load_full_state(moments, state["optimizer_step"])
        if state["layout"] == self.config.to_dict()["parallel"]:
            load_rng(latest, self.mesh.rank)
        self.start_step = state["step"]
        self.resumed_from = latest
        return latest
