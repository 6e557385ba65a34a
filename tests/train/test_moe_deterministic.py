"""`train.deterministic` makes resuming across a change of ep bit for bit: a dp4 ep2 run saved at
step 2 and resumed at ep4 and at ep1 (dp4) has the uninterrupted run's losses and final weights and
Adam moments, `torch.equal` (and dp2 x tp2, dp2 x pp2 from ep2 to ep1); without the flag the same
resume differs in the last bits."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shiftlm.comm import tree_sum
from shiftlm.errors import ConfigError
from shiftlm.train.config import load_config
from shiftlm.train.setup import model_shape
from tests.train.conftest import run_training

STEPS = 5
BASE = [
    "--train.seq_len=32",
    "--train.global_batch=8",  # 2 micro-batches per rank: the per-source accumulators
    "--train.micro_batch=1",
    f"--train.steps={STEPS}",
    "--optim.warmup_steps=2",
    "--optim.grad_clip=0.5",  # every step clipped: the norm's bits matter
    "--checkpoint.every=2",
    "--checkpoint.keep=5",
    "--log.progress=off",
]
DP4 = "--parallel.dp=4"


def _final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the step-5 checkpoint: weights and Adam moments, by name."""
    checkpoint = run_dir / "checkpoints" / f"step_{STEPS:08d}"
    out: dict[str, torch.Tensor] = {}
    for file in [*checkpoint.glob("model/*.safetensors"), *checkpoint.glob("optimizer-*.safetensors")]:
        out.update(load_file(file))
    return out


def _resume_at(ranks, moe_model, saved: Path, copy: Path, overrides: list[str]) -> dict[int, float]:
    """Steps 3-5 from a copy of `saved` whose newest checkpoint is step 2, at the layout `overrides`."""
    shutil.copytree(saved, copy)
    for later in ("step_00000004", f"step_{STEPS:08d}"):
        shutil.rmtree(copy / "checkpoints" / later)
    losses = ranks.run(
        4, run_training, [moe_model, *BASE], [*overrides, "--checkpoint.resume=true"], str(copy)
    )
    assert list(losses[0]) == [3, 4, 5]
    return losses[0]


def _run_and_resume(ranks, moe_model, tmp_path: Path, flag: list[str], eps: list[int], layout=(DP4,)):
    """The uninterrupted ep2 run at `layout` (4 ranks; losses, final state), and for each ep in `eps`
    the run resumed from its step-2 checkpoint at that ep (losses, final state)."""
    full_dir = tmp_path / "ep2"
    full = ranks.run(
        4,
        run_training,
        [moe_model, *BASE],
        [*layout, "--parallel.ep=2", *flag, "--checkpoint.resume=false"],
        str(full_dir),
    )[0]
    resumed = {}
    for ep in eps:
        copy = tmp_path / f"ep2_to_ep{ep}"
        losses = _resume_at(ranks, moe_model, full_dir, copy, [*layout, f"--parallel.ep={ep}", *flag])
        resumed[ep] = losses, _final_state(copy)
    return (full, _final_state(full_dir)), resumed


def test_deterministic_resume_across_ep_is_bit_for_bit(ranks, moe_model, tmp_path):
    (full, state), resumed = _run_and_resume(
        ranks, moe_model, tmp_path, ["--train.deterministic=true"], [4, 1]
    )
    assert full[STEPS] < full[1]  # it learns
    assert any(".experts." in name for name in state) and any(name.startswith("exp_avg.") for name in state)
    for ep, (losses, again) in resumed.items():
        assert losses == {step: full[step] for step in (3, 4, 5)}, f"ep{ep}"  # float equality: the bits
        assert again.keys() == state.keys()
        for name, tensor in state.items():
            assert torch.equal(again[name], tensor), f"ep{ep}: {name}"


@pytest.mark.parametrize(
    "layout",
    [("--parallel.dp=2", "--parallel.tp=2"), ("--parallel.dp=2", "--parallel.pp=2", "--train.schedule=1f1b")],
    ids=["dp2_tp2", "dp2_pp2"],
)
def test_deterministic_resume_from_ep2_to_ep1_with_tp_or_pp_is_bit_for_bit(
    ranks, moe_model, tmp_path, layout
):
    (full, state), resumed = _run_and_resume(
        ranks, moe_model, tmp_path, ["--train.deterministic=true"], [1], layout
    )
    losses, again = resumed[1]
    assert losses == {step: full[step] for step in (3, 4, 5)}
    assert again.keys() == state.keys()
    assert all(torch.equal(again[name], tensor) for name, tensor in state.items())


def test_without_the_flag_resume_across_ep_differs_in_the_last_bits(ranks, moe_model, tmp_path):
    """The negative control: the same resume at ep4 without `train.deterministic` is equal to 1e-5
    (tests/train/test_moe_checkpoint.py) but not bit for bit, so the test above can fail."""
    (full, state), resumed = _run_and_resume(ranks, moe_model, tmp_path, [], [4])
    losses, again = resumed[4]
    assert all(losses[step] == pytest.approx(full[step], rel=1e-5) for step in losses)
    differs = [name for name, tensor in state.items() if not torch.equal(again[name], tensor)]
    assert differs, "ep4 without the flag gave ep2's bits: the bit-exact test above would prove nothing"


def test_tree_sum_is_the_order_of_aligned_blocks():
    """Summing aligned pairs first, then the pair sums, is tree_sum of all four: the identity that
    makes the holder's local sum followed by the edp sum the ep1 order (and another order is not)."""
    torch.manual_seed(0)
    parts = [torch.randn(1000) * 10.0**k for k in range(4)]
    assert torch.equal(tree_sum(parts), tree_sum([tree_sum(parts[:2]), tree_sum(parts[2:])]))
    assert not torch.equal(tree_sum(parts), ((parts[0] + parts[1]) + parts[2]) + parts[3])


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["--train.zero=2"], "train.zero = 2"),
        (["--parallel.ep=2", "--parallel.etp=1", "--parallel.tp=2"], "etp"),
    ],
)
def test_deterministic_refuses_what_it_does_not_cover(moe_model, overrides, words):
    config = load_config(None, [moe_model, DP4, "--train.deterministic=true", *overrides])
    with pytest.raises(ConfigError, match=words):
        model_shape(config)
