"""Every layout trains the same model: the first 20 losses agree with one rank to 1e-5 (fp32)."""

from __future__ import annotations

import pytest

from tests.train.conftest import run_training

STEPS = 20
BASE = [
    "--model.name=micro",
    "--train.seq_len=32",
    "--train.global_batch=4",
    "--train.micro_batch=1",
    f"--train.steps={STEPS}",
    "--optim.warmup_steps=2",
    "--checkpoint.resume=false",
    "--log.progress=off",
]


def train_losses(overrides: list[str], log_dir: str) -> dict[int, float]:
    return run_training(BASE, overrides, log_dir)


@pytest.fixture(scope="module")
def single_rank_losses(ranks, tmp_path_factory):
    return ranks.run(1, train_losses, [], str(tmp_path_factory.mktemp("one")))[0]


LAYOUTS = {
    "dp2": ["--parallel.dp=2", "--train.micro_batch=2"],
    "dp2_accumulate2": ["--parallel.dp=2"],
    "tp2": ["--parallel.tp=2"],
    "tp2_megatron_sp": ["--parallel.tp=2", "--parallel.sequence_parallel=true"],
    "sp2": ["--parallel.sp=2"],
    "pp2_1f1b": ["--parallel.pp=2", "--train.schedule=1f1b"],
    "pp2_zb_v": ["--parallel.pp=2", "--train.schedule=zb_v"],
    "pp2_bitpipe": ["--parallel.pp=2", "--train.schedule=bitpipe"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_rank_layout_matches_one_rank_losses(ranks, tmp_path, single_rank_losses, layout):
    losses = ranks.run(2, train_losses, LAYOUTS[layout], str(tmp_path))
    assert losses[0] == losses[1]  # every rank reports the same global loss
    assert list(losses[0]) == list(range(1, STEPS + 1))
    for step, reference in single_rank_losses.items():
        assert losses[0][step] == pytest.approx(reference, rel=1e-5), f"step {step}"
    assert single_rank_losses[STEPS] < single_rank_losses[1]  # and it is learning


def test_four_rank_mix_matches_one_rank_losses(ranks, tmp_path, single_rank_losses):
    overrides = ["--parallel.dp=2", "--parallel.tp=2", "--parallel.pp=1", "--parallel.sp=1"]
    losses = ranks.run(4, train_losses, overrides, str(tmp_path))[0]
    for step, reference in single_rank_losses.items():
        assert losses[step] == pytest.approx(reference, rel=1e-5), f"step {step}"


@pytest.fixture(scope="module")
def tied_single_rank_losses(ranks, tmp_path_factory, tied_qwen2_model):
    return ranks.run(1, train_losses, [tied_qwen2_model], str(tmp_path_factory.mktemp("tied_one")))[0]


# 1f1b: embedding and head copy on different ranks; zb_v: both on rank 0; bitpipe: both per replica
@pytest.mark.parametrize("schedule", ["1f1b", "zb_v", "bitpipe"])
def test_tied_embeddings_at_pp2_match_one_rank_losses(
    ranks, tmp_path, tied_qwen2_model, tied_single_rank_losses, schedule
):
    overrides = [tied_qwen2_model, "--parallel.pp=2", f"--train.schedule={schedule}"]
    losses = ranks.run(2, train_losses, overrides, str(tmp_path))[0]
    for step, expected in tied_single_rank_losses.items():
        assert losses[step] == pytest.approx(expected, rel=1e-5), f"step {step}"
