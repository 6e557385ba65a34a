"""A mixture-of-experts layout `shiftlm train` cannot run is refused in one line naming the fix, with
exit code 2, before any rank starts (the same checks as verify and serve: `ParallelConfig.check_experts`,
`ModelConfig`'s top-k range)."""

from __future__ import annotations

import json

import pytest

from shiftlm.cli import main
from tests.train.conftest import moe_qwen2_config

USAGE = 2
MICRO = ["--train.seq_len=32", "--train.global_batch=12", "--log.progress=off"]


def _model_dir(tmp_path, **raw_changes) -> str:
    directory = tmp_path / "model"
    directory.mkdir()
    raw = {**moe_qwen2_config().to_hf_dict(), **raw_changes}
    (directory / "config.json").write_text(json.dumps(raw))
    return f"--model.name={directory}"


@pytest.mark.parametrize(
    ("argv", "raw", "fragments"),
    [
        (["--parallel.dp=3", "--parallel.ep=3", "--nproc", "3"], {}, ["ep = 3 must divide num_experts = 4"]),
        (
            ["--parallel.dp=3", "--parallel.ep=2", "--nproc", "3"],
            {},
            ["ep = 2 must divide the data-parallel ranks dp*cp*sp = 3", "raise dp to a multiple of 2"],
        ),
        (
            [],
            {"num_experts_per_tok": 5},
            ["num_experts_per_tok = 5 must be between 1 and num_experts = 4"],
        ),
        (
            ["--parallel.dp=2", "--parallel.ep=2", "--nproc", "2"],
            {"model_type": "qwen2"},
            ["needs a mixture-of-experts"],
        ),
        (
            ["--parallel.pp=2", "--nproc", "2", "--data.format=streams"],
            {},
            ["MoE load-balancing loss", "needs pp = 1"],
        ),
    ],
    ids=[
        "ep_not_dividing_experts",
        "ep_not_dividing_dp",
        "top_k_above_experts",
        "ep_on_dense",
        "streams_aux_pp",
    ],
)
def test_a_bad_moe_layout_is_one_line_before_any_rank_starts(capsys, tmp_path, argv, raw, fragments):
    run = tmp_path / "run"
    code = main(["train", _model_dir(tmp_path, **raw), *MICRO, f"--log.dir={run}", *argv])
    err = capsys.readouterr().err
    assert code == USAGE, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not run.exists()  # no rank ran
