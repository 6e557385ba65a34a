"""MoE checkpoints reshard across ep like every other axis: a run saved at ep2 resumes at ep1 and at
ep4 with the losses of the uninterrupted run, and what a rank loads at another ep is the saved state
bit for bit (re-saved without a step, every tensor, weights and Adam moments, is identical)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from shiftlm.train.config import load_config
from shiftlm.train.trainer import Trainer
from tests.train.conftest import run_training

STEPS = 5
BASE = [
    "--train.seq_len=32",
    "--train.global_batch=4",
    "--train.micro_batch=1",
    f"--train.steps={STEPS}",
    "--optim.warmup_steps=2",
    "--checkpoint.every=3",
    "--log.progress=off",
]
EP2 = ["--parallel.dp=2", "--parallel.ep=2"]


@pytest.fixture(scope="module")
def saved_at_ep2(ranks, moe_model, tmp_path_factory) -> tuple[dict[int, float], Path]:
    """The uninterrupted ep2 run's losses and its log dir (checkpoints at steps 3 and 5)."""
    log_dir = tmp_path_factory.mktemp("ep2")
    losses = ranks.run(2, run_training, [moe_model, *BASE], [*EP2, "--checkpoint.resume=false"], str(log_dir))
    return losses[0], log_dir


def _at_step_3(saved: Path, copy: Path) -> Path:
    """A copy of the run directory whose newest checkpoint is step 3."""
    shutil.copytree(saved, copy)
    shutil.rmtree(copy / "checkpoints" / "step_00000005")
    return copy


@pytest.mark.parametrize(
    "world,layout",
    [(2, ["--parallel.dp=2"]), (4, ["--parallel.dp=4", "--parallel.ep=4"])],
    ids=["ep2_to_ep1", "ep2_to_ep4"],
)
def test_a_checkpoint_saved_at_ep2_resumes_at_another_ep(
    ranks, moe_model, tmp_path, saved_at_ep2, world, layout
):
    full, saved = saved_at_ep2
    run_dir = _at_step_3(saved, tmp_path / "run")
    rest = ranks.run(
        world, run_training, [moe_model, *BASE], [*layout, "--checkpoint.resume=true"], str(run_dir)
    )
    assert list(rest[0]) == [4, 5]
    for step, loss in rest[0].items():
        assert loss == pytest.approx(full[step], rel=1e-5), f"step {step}"


def resave(base: list[str], overrides: list[str], log_dir: str) -> None:
    """Resume the newest checkpoint of `log_dir` and save it again at once (no step)."""
    config = load_config(None, [*base, f"--log.dir={log_dir}", "--checkpoint.resume=true", *overrides])
    trainer = Trainer(config, quiet=True)
    trainer.maybe_resume()
    trainer.save(trainer.start_step)
    if dist.is_initialized():
        dist.barrier()


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    files = [*checkpoint.glob("model/*.safetensors"), *checkpoint.glob("optimizer-*.safetensors")]
    out: dict[str, torch.Tensor] = {}
    for file in files:
        out.update(load_file(file))
    return out


def test_the_state_loaded_at_another_ep_is_the_saved_state_bit_for_bit(
    ranks, moe_model, tmp_path, saved_at_ep2
):
    _, saved = saved_at_ep2
    original = _tensors(saved / "checkpoints" / "step_00000003")
    assert any(".experts." in name for name in original) and any(n.startswith("exp_avg.") for n in original)
    for world, layout in ((1, []), (4, ["--parallel.dp=4", "--parallel.ep=4", "--train.zero=3"])):
        run_dir = _at_step_3(saved, tmp_path / f"ep_{world}")
        ranks.run(world, resave, [moe_model, *BASE], layout, str(run_dir))
        again = _tensors(run_dir / "checkpoints" / "step_00000003")
        assert again.keys() == original.keys()
        for name, tensor in original.items():
            assert torch.equal(again[name], tensor), f"{layout}: {name}"
