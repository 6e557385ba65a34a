"""Training with context parallelism (ring attention) follows the single-rank run: the losses of
cp=2, cp=2 x pp=2, cp=2 x dp=2 and cp=2 with full recomputation agree with one rank to 1e-5 (fp32, sequences of 24 tokens, which
is not a power of two), for llama and a tied qwen2; checkpoints written at cp=2 resume at cp=1."""

from __future__ import annotations

import pytest

from tests.train.conftest import run_training

STEPS = 6
BASE = [
    "--train.seq_len=24",
    "--train.global_batch=4",
    "--train.micro_batch=1",
    f"--train.steps={STEPS}",
    "--optim.warmup_steps=2",
    "--checkpoint.resume=false",
    "--log.progress=off",
]


def train_losses(overrides: list[str], log_dir: str, stop_after: int | None = None) -> dict[int, float]:
    return run_training(BASE, overrides, log_dir, stop_after)


@pytest.fixture(scope="module")
def models(tied_qwen2_model):
    return {"llama": "--model.name=micro", "qwen2": tied_qwen2_model}


_single: dict[str, dict[int, float]] = {}


def _one_rank(ranks, model: str, log_dir: str) -> dict[int, float]:
    if model not in _single:
        _single[model] = ranks.run(1, train_losses, [model], log_dir)[0]
    return _single[model]


LAYOUTS = {
    "cp2": (2, ["--parallel.cp=2"]),
    "cp2_pp2": (4, ["--parallel.cp=2", "--parallel.pp=2", "--train.schedule=1f1b"]),
    "cp2_dp2": (4, ["--parallel.cp=2", "--parallel.dp=2"]),
    "cp2_recompute_full": (2, ["--parallel.cp=2", "--train.recompute=full"]),  # the ring reruns in backward
}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cp_training_matches_one_rank_losses(ranks, tmp_path, models, family, layout):
    world, overrides = LAYOUTS[layout]
    single = _one_rank(ranks, models[family], str(tmp_path / "one"))
    losses = ranks.run(world, train_losses, [models[family], *overrides], str(tmp_path / "cp"))
    assert all(rank_losses == losses[0] for rank_losses in losses)  # one global loss on every rank
    assert list(losses[0]) == list(range(1, STEPS + 1))
    for step, reference in single.items():
        assert losses[0][step] == pytest.approx(reference, rel=1e-5), f"step {step}"
    assert single[STEPS] < single[1]  # and it is learning


def test_checkpoint_written_at_cp2_resumes_at_cp1(ranks, tmp_path, models):
    single = _one_rank(ranks, models["llama"], str(tmp_path / "one"))
    ranks.run(
        2, train_losses, [models["llama"], "--parallel.cp=2", "--checkpoint.every=3"], str(tmp_path / "r"), 3
    )
    rest = ranks.run(1, train_losses, [models["llama"], "--checkpoint.resume=true"], str(tmp_path / "r"))[0]
    assert list(rest) == [4, 5, 6]
    for step, loss in rest.items():
        assert loss == pytest.approx(single[step], rel=1e-5), f"step {step}"


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["--parallel.cp=2", "--train.seq_len=30"], "must split into 2*cp*sp = 4 equal chunks"),
        (
            ["--parallel.cp=2", "--parallel.sp=2", "--train.seq_len=4"],
            "2*cp*sp = 8 is larger than the sequence",
        ),
    ],
)
def test_train_refuses_sequences_the_zigzag_split_cannot_cut(tmp_path, overrides, message):
    import os
    import subprocess
    import sys

    world = 4 if "--parallel.sp=2" in overrides else 2
    result = subprocess.run(
        [sys.executable, "-m", "shiftlm.cli", "train", f"--nproc={world}", "--model.name=micro"]
        + overrides
        + [f"--log.dir={tmp_path}"],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
