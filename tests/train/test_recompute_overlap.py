"""Execution choices that must not change the numbers: activation recomputation (none, selective,
full) and overlapping the data-parallel gradient sync with a pipeline step."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from shiftlm.config import ModelConfig
from shiftlm.train.config import load_config
from shiftlm.train.setup import EMBEDDED_MODELS
from shiftlm.train.trainer import Trainer

STEPS = 3
BASE = [
    "--model.name=micro",
    "--train.seq_len=32",
    "--train.global_batch=4",
    "--train.micro_batch=1",
    f"--train.steps={STEPS}",
    "--optim.warmup_steps=2",
    "--checkpoint.resume=false",
    "--checkpoint.every=1000",
    "--log.progress=off",
]

MICRO = ModelConfig(vocab_size=2048, **EMBEDDED_MODELS["micro"])


def losses_and_started_buckets(overrides: list[str], log_dir: str) -> tuple[dict[int, float], int]:
    """Train; also report how many all-reduce buckets had started when the last step's
    forward/backward (the pipeline schedule) returned, before the trainer's own `finish()`."""
    trainer = Trainer(load_config(None, [*BASE, f"--log.dir={log_dir}", *overrides]), quiet=True)
    started_during_backward = []
    run = trainer.runner.run

    def run_and_count(*args):
        loss = run(*args)
        started_during_backward.append(trainer.grad_sync.started_buckets)
        return loss

    trainer.runner.run = run_and_count
    losses = trainer.run().losses
    if dist.is_initialized():
        dist.barrier()
    return losses, started_during_backward[-1]


# layout -> (world size, overrides, recompute modes compared with "none")
CASES = {
    "one_rank": (1, [], ("selective", "full")),
    "pp2_1f1b": (2, ["--parallel.pp=2", "--train.schedule=1f1b"], ("full",)),  # through the executor
    "pp2_zb_v": (2, ["--parallel.pp=2", "--train.schedule=zb_v"], ("selective", "full")),  # I/W split
    "sp2": (2, ["--parallel.sp=2"], ("full",)),  # full recomputation repeats the Ulysses all-to-alls
}


@pytest.mark.parametrize("layout", list(CASES))
def test_recomputation_gives_bit_identical_losses(ranks, tmp_path, layout):
    world, overrides, modes = CASES[layout]
    for mode in ("none", *modes):
        overrides_for_mode = [*overrides, f"--train.recompute={mode}"]
        losses = ranks.run(world, losses_and_started_buckets, overrides_for_mode, str(tmp_path / mode))[0][0]
        if mode == "none":
            reference = losses
        assert losses == reference, mode


@pytest.mark.parametrize("schedule", ["zb_v", "bitpipe"])
def test_overlapped_dp_sync_in_a_pipeline_is_bit_identical(ranks, tmp_path, schedule):
    # 16 KiB buckets: the micro model's stages span several, so stages finishing early start theirs
    layout = ["--parallel.dp=2", "--parallel.pp=2", f"--train.schedule={schedule}", "--train.bucket_mb=0.016"]
    overlapped = ranks.run(4, losses_and_started_buckets, layout, str(tmp_path / "on"))
    serial = ranks.run(
        4, losses_and_started_buckets, [*layout, "--train.overlap_grad_sync=false"], str(tmp_path / "off")
    )
    assert [losses for losses, _ in overlapped] == [losses for losses, _ in serial]
    assert all(started == 0 for _, started in serial)
    assert all(started > 0 for _, started in overlapped)  # launched from the executor's callback
