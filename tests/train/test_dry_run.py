"""`shiftlm train --dry-run` (issue 18): the plan for Llama-3-70B on 64 H100s is accepted, the stand-in
keeps the layout's structure, and its one step equals one rank's."""

from __future__ import annotations

import itertools
import json

import pytest

from shiftlm.cli import main
from shiftlm.errors import ConfigError
from shiftlm.train.config import load_config
from shiftlm.train.dryrun import AXES, scaled_degrees


def test_the_70b_plan_for_64_h100s_passes_the_dry_run(capsys, tmp_path):
    plan = tmp_path / "plan.toml"
    args = "plan train --model llama3-70b --gpu h100-sxm --gpus 64 --seq 8192 --global-batch 512 --json"
    assert main([*args.split(), "--out", str(plan)]) == 0
    capsys.readouterr()
    # 4 local ranks, not the default 8: the plan's 8-rank stand-ins run in tests/sim/test_plans_run.py
    assert main(["train", "--dry-run", "--dry-run-ranks", "4", "--config", str(plan), "--json"]) == 0
    phases = json.loads(capsys.readouterr().out)
    config = load_config(plan)
    real = {axis: getattr(config.parallel, axis) for axis in AXES}
    assert phases["config"]["layout"] == real and phases["config"]["world_size"] == 64
    stand_in = phases["stand_in"]["layout"]
    assert all((stand_in[a] > 1) == (real[a] > 1) for a in AXES)  # the same axes are parallel
    assert phases["step"]["ranks"] == 4 and phases["config"]["zero"] == config.train.zero
    assert phases["check"]["rel_diff"]["loss"] <= 1e-5 and phases["check"]["rel_diff"]["grad_norm"] <= 5e-5
    assert phases["step"]["loss"] > 0 and phases["memory"]["per_rank_gib"]["total"] > 0


def test_one_line_per_phase(capsys, tmp_path):
    args = "train --dry-run --parallel.pp=2 --train.schedule=zb_v --parallel.dp=2 --train.zero=3"
    assert main([*args.split(), "--model.name=micro", f"--log.dir={tmp_path}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["config", "memory", "stand-in", "step", "check"]
    assert "equal to one rank" in lines[-1]


@pytest.mark.parametrize("degrees", list(itertools.product((1, 2, 4, 16), (1, 2, 8), (1, 4), (1, 2), (1, 8))))
def test_the_stand_in_keeps_every_parallel_axis_and_fits_the_ranks(degrees):
    overrides = [f"--parallel.{axis}={d}" for axis, d in zip(AXES, degrees)]
    config = load_config(None, [*overrides, f"--train.global_batch={8 * degrees[0]}"])
    parallel_axes = sum(d > 1 for d in degrees)
    if 2**parallel_axes > 8:
        with pytest.raises(ConfigError, match="--dry-run-ranks"):
            scaled_degrees(config, 8)
        return
    scaled = scaled_degrees(config, 8)
    world = 1
    for axis, real in zip(AXES, degrees):
        assert (scaled[axis] > 1) == (real > 1) and scaled[axis] <= real
        world *= scaled[axis]
    assert world <= 8
    if config.parallel.world_size <= 8:
        assert scaled == dict(zip(AXES, degrees))  # small layouts run as they are


def test_a_layout_the_model_cannot_take_fails_before_any_rank_starts(capsys):
    assert main(["train", "--dry-run", "--model.name=llama3-70b", "--parallel.tp=3"]) == 2
    assert "tp" in capsys.readouterr().err
