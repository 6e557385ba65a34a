"""Expert tensor parallelism (`etp`, the experts' own TP size, Megatron-Core's MoE parallel folding):
etp2 x ep2, tp2 x etp1 x ep2 (with and without Megatron SP, with Ulysses sp2, with pp2 under ZB-V) and
ZeRO-3 with etp give one rank's losses,
load-balancing loss included, over 5 steps and its step-1 gradients (fp32, 1e-5); a checkpoint saved
at one etp resumes at another; a bad etp is one line before any rank starts."""

from __future__ import annotations

import shutil

import pytest

from shiftlm.cli import main
from shiftlm.mesh import coords_of, expert_coords
from shiftlm.model.moe import SparseMoE
from shiftlm.model.sharding import shard_spec
from shiftlm.model.weights import take_shard
from shiftlm.train.config import load_config
from tests.train.conftest import moe_qwen2_config, run_training
from tests.train.test_moe_checkpoint import BASE as SAVE  # checkpoints every 3 of 5 steps
from tests.train.test_moe_training import STEPS, TOLERANCE, losses_and_first_grads

LAYOUTS = {  # world size, overrides; the stage's dp*cp*sp*tp ranks are cut as edp x ep x etp
    "etp2_x_ep2": (4, ["--parallel.dp=4", "--parallel.ep=2", "--parallel.etp=2"]),
    "tp2_x_etp1_x_ep2": (4, ["--parallel.dp=2", "--parallel.tp=2", "--parallel.etp=1", "--parallel.ep=2"]),
    "tp2_sp_x_etp1_x_ep2": (
        2,
        ["--parallel.tp=2", "--parallel.sequence_parallel=true", "--parallel.etp=1", "--parallel.ep=2"],
    ),
    "tp2_x_sp2_x_etp1_x_ep4": (
        4,
        ["--parallel.tp=2", "--parallel.sp=2", "--parallel.etp=1", "--parallel.ep=4"],
    ),
    "tp2_x_etp1_x_ep2_x_pp2_zbv": (
        4,
        [
            "--parallel.tp=2",
            "--parallel.pp=2",
            "--parallel.etp=1",
            "--parallel.ep=2",
            "--train.schedule=zb_v",
        ],
    ),
    "etp2_zero3": (4, ["--parallel.dp=4", "--parallel.etp=2", "--train.zero=3"]),
}


@pytest.fixture(scope="module")
def one_rank(ranks, moe_model, tmp_path_factory):
    return ranks.run(1, losses_and_first_grads, [moe_model], str(tmp_path_factory.mktemp("one")))[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_etp_layout_losses_and_first_gradients_equal_one_rank(ranks, tmp_path, moe_model, one_rank, layout):
    world, overrides = LAYOUTS[layout]
    runs = ranks.run(world, losses_and_first_grads, [moe_model, *overrides], str(tmp_path))
    _assert_equal_one_rank(layout, runs, one_rank, load_config(None, [moe_model, *overrides]).parallel)


def all_gather_dispatch_run(overrides: list[str], log_dir: str) -> tuple:
    """`losses_and_first_grads` with every MoE layer dispatching by all-gather (`SparseMoE.dispatch`),
    and how many times this rank's layers took that path."""
    original_init, original_gathered = SparseMoE.__init__, SparseMoE.gathered_experts
    calls = []

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.dispatch = "all_gather"

    def gathered(self, *args):
        calls.append(1)
        return original_gathered(self, *args)

    SparseMoE.__init__, SparseMoE.gathered_experts = init, gathered
    try:
        return losses_and_first_grads(overrides, log_dir), len(calls)
    finally:
        SparseMoE.__init__, SparseMoE.gathered_experts = original_init, original_gathered


@pytest.mark.parametrize("layout", ["etp2_x_ep2", "tp2_x_etp1_x_ep2", "tp2_sp_x_etp1_x_ep2"])
def test_all_gather_dispatch_at_etp_not_tp_equals_one_rank(ranks, tmp_path, moe_model, one_rank, layout):
    """The all-gather dispatcher inside the folded layer (gather over etp, then over ep; reduce-scatter
    back over ep, then over etp) gives one rank's losses and step-1 gradients as the all-to-all does."""
    world, overrides = LAYOUTS[layout]
    results = ranks.run(world, all_gather_dispatch_run, [moe_model, *overrides], str(tmp_path))
    assert all(calls > 0 for _, calls in results)  # every rank dispatched by all-gather
    runs = [run for run, _ in results]
    _assert_equal_one_rank(layout, runs, one_rank, load_config(None, [moe_model, *overrides]).parallel)


def _assert_equal_one_rank(layout: str, runs: list, one_rank: tuple, parallel) -> None:
    """Every rank's 5 losses and grad norms equal one rank's, and its step-1 gradients (its TP and
    etp shards, its experts) equal the matching slices of one rank's (1e-5 relative)."""
    (one_losses, one_norms), one_grads, _ = one_rank
    worst = loss_error = 0.0
    for rank, ((losses, norms), _, _) in enumerate(runs):
        assert list(losses) == list(range(1, STEPS + 1))
        for step, reference in one_losses.items():
            assert losses[step] == pytest.approx(reference, rel=TOLERANCE), f"rank {rank} step {step}"
            loss_error = max(loss_error, abs(losses[step] - reference) / abs(reference))
            assert norms[step] == pytest.approx(one_norms[step], rel=TOLERANCE), (
                f"norm: rank {rank} step {step}"
            )
    config, seen = moe_qwen2_config(), set()
    for rank, (_, grads, (tp_rank, tp_size)) in enumerate(runs):
        etp_rank = expert_coords(parallel, coords_of(parallel, rank))[2]  # expert shards are cut over etp
        for name, grad in grads.items():
            split = (etp_rank, parallel.expert_tp) if ".experts." in name else (tp_rank, tp_size)
            expected = take_shard(one_grads[name], shard_spec(name, config, *split))
            assert grad.shape == expected.shape, f"rank {rank} {name}"
            error = ((grad - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item()
            assert error <= TOLERANCE, f"rank {rank} {name}: relative error {error:.2e}"
            worst = max(worst, error)
            seen.add(name)
    assert seen == set(one_grads)  # every parameter, each expert shard on some rank
    print(f"{layout}: max relative loss error {loss_error:.1e}, gradient error {worst:.1e}")


def test_a_checkpoint_saved_at_etp2_resumes_at_etp1_and_tp2(ranks, moe_model, tmp_path):
    """Saved at dp2 etp2 (each expert split over both ranks), resumed at step 3 at tp2 x etp1 x ep2
    (each expert whole on one rank): steps 4-5 equal the uninterrupted run's (1e-5)."""
    saved = tmp_path / "etp2"
    etp2 = ["--parallel.dp=2", "--parallel.etp=2"]
    full = ranks.run(2, run_training, [moe_model, *SAVE], [*etp2, "--checkpoint.resume=false"], str(saved))[0]
    run_dir = tmp_path / "run"
    shutil.copytree(saved, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000005")
    layout = ["--parallel.tp=2", "--parallel.etp=1", "--parallel.ep=2", "--checkpoint.resume=true"]
    rest = ranks.run(2, run_training, [moe_model, *SAVE], layout, str(run_dir))[0]
    assert list(rest) == [4, 5]
    for step, loss in rest.items():
        assert loss == pytest.approx(full[step], rel=TOLERANCE), f"step {step}"


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--parallel.dp=2", "--parallel.etp=64"], "etp = 64 is larger than an expert's width"),
        (["--parallel.dp=2", "--parallel.etp=3"], "etp = 3 must divide moe_intermediate_size"),
        (
            ["--parallel.dp=2", "--parallel.etp=2", "--parallel.ep=2"],
            "ep x etp = 4 must divide the dp*cp*sp*tp = 2",
        ),
        (["--parallel.tp=2", "--parallel.etp=1"], "ep x etp = 1 must be a multiple of tp = 2"),
    ],
    ids=["etp_above_width", "etp_not_dividing_width", "ep_x_etp_above_ranks", "edp_above_dp"],
)
def test_a_bad_etp_is_one_line_before_any_rank_starts(capsys, tmp_path, moe_model, argv, fragment):
    run = tmp_path / "run"
    micro = ["--train.seq_len=32", "--train.global_batch=4", "--log.progress=off", f"--log.dir={run}"]
    code = main(["train", moe_model, *micro, *argv, "--nproc", "2"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert fragment in lines[0], lines[0]
    assert not run.exists()  # no rank ran


def test_verify_takes_etp():
    """`shiftlm verify --etp`: tiny Qwen2-MoE at ep2 x tp2 with each expert whole (etp 1) equals
    transformers (logits and input gradients, 1e-5 relative)."""
    import subprocess
    import sys

    argv = ["verify", "--tiny", "qwen2-moe", "--ep", "2", "--tp", "2", "--etp", "1"]
    result = subprocess.run(
        [sys.executable, "-m", "shiftlm.cli", *argv], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "etp=1 (dp=1)" in result.stdout and "all layouts match" in result.stdout
