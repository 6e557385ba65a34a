"""`shiftlm simulate|plan train --compile / --no-compile` (issue 31, item 4): the step of `shiftlm
train --train.compile=true|false`. Eager takes a calibrated profile's `step_overhead_eager` host time
and moves the unfused pointwise ops' bytes; compiled takes `step_overhead_compiled` and moves none;
the default is the trainer's own (`train.compile = auto`) on that hardware."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shiftlm.cli import main
from shiftlm.config import ModelConfig
from shiftlm.hardware import GEMM_ROLES, save_profile
from shiftlm.sim.calibrate_device import device_profile
from shiftlm.sim.layout import eager_llama_pointwise_bytes

MODEL = ModelConfig(num_layers=2)
SEQ, MICRO_BATCH, MICRO_BATCHES = 512, 4, 2
SHIPPED_CPU_PROFILE = Path(__file__).parents[2] / "bench/results/sim_vs_measured_profile.json"


def _gpu_profile(tmp_path, memory: float = 4.2e12, op: float = 5e-6, **overheads: float) -> Path:
    """A calibrated H200 as `calibrate_device` writes it, with the given `step_overhead_*` times."""
    measured = {
        "gemm": {(role, 8192, 2048, 2048): 6.5e14 for role in GEMM_ROLES},
        "attention": {2048: (3.0e14, 2.5e14)},
        "memory": memory,
        "op": op,
    } | {f"step_overhead_{mode}": seconds for mode, seconds in overheads.items()}
    path = tmp_path / "hardware.json"
    save_profile(device_profile(measured, "NVIDIA H200", 141e9, 1, "bf16"), path)
    return path


def _simulate(
    tmp_path, capsys, hardware: list[str], *flags: str, gpus: int = 1
) -> tuple[int, dict | None, str]:
    model = tmp_path / "config.json"
    model.write_text(json.dumps(MODEL.to_hf_dict()))
    argv = ["simulate", "train", *hardware, "--model", str(model), "--gpus", str(gpus), "--seq", str(SEQ)]
    argv += ["--micro-batch", str(MICRO_BATCH), "--global-batch", str(MICRO_BATCH * MICRO_BATCHES)]
    code = main([*argv, *flags, "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else None, err


def test_eager_is_longer_by_the_host_time_and_the_pointwise_traffic(tmp_path, capsys):
    """One GPU, no pipeline: the step is the micro-batches' layer passes plus the head and the
    optimizer, which no mode changes. Each pass takes (device^8 + host^8)^(1/8) (`costs.overlapped`);
    with a host time per layer >= 10x the device's that is the host time to ~1e-9, so the modes
    differ by the host time per layer x layers x micro-batches, plus the eager block's pointwise
    bytes (added after the overlap, `train.activation_traffic_stage_costs`): once in the forward
    and twice in the backward at the profile's copy bandwidth."""
    eager, compiled, memory = 4e-3, 2e-3, 1e11  # a slow copy, so that the traffic shows beside the host
    profile = _gpu_profile(tmp_path, memory, 1e-7, eager=eager, compiled=compiled)
    hardware = ["--gpu", "this", "--hardware", str(profile)]
    runs = {
        mode: _simulate(tmp_path, capsys, hardware, flag)
        for mode, flag in ((True, "--compile"), (False, "--no-compile"))
    }
    for mode, (code, report, err) in runs.items():
        assert code == 0 and err == "" and report["compile"] is mode
    host = MICRO_BATCHES * MODEL.num_layers * (eager - compiled)
    pointwise = eager_llama_pointwise_bytes(MODEL, 2, repeat_kv=False)  # bf16; GQA broadcasts, no copies
    traffic = MICRO_BATCHES * MODEL.num_layers * 3 * MICRO_BATCH * SEQ * pointwise / memory
    assert traffic > 0.05 * host  # both terms show in the difference
    difference = runs[False][1]["step_time_s"] - runs[True][1]["step_time_s"]
    assert difference == pytest.approx(host + traffic, rel=1e-6)
    assert runs[False][1]["layout"]["pointwise_bytes"] == pointwise
    assert runs[True][1]["layout"]["pointwise_bytes"] == 0


@pytest.mark.parametrize("schedule,splits", [("zb_h1", True), ("zb_h2", True), ("1f1b", False)])
def test_compiled_zero_bubble_schedules_are_priced_as_the_eager_step_they_run(
    schedule, splits, tmp_path, capsys
):
    """A zero-bubble schedule splits every micro-batch's backward into I + W, whose weight gradients
    the executor queues from Python, so the trainer runs those blocks eagerly even under
    `train.compile` (model/compile.py): compiled, such a step is the eager one to the last
    microsecond, host time and pointwise traffic included; 1F1B's blocks run compiled."""
    profile = _gpu_profile(tmp_path, 1e11, 1e-7, eager=4e-3, compiled=2e-3)
    hardware = ["--gpu", "this", "--hardware", str(profile), "--pp", "2", "--schedule", schedule]
    steps = {
        flag: _simulate(tmp_path, capsys, hardware, flag, gpus=2)[1]["step_time_s"]
        for flag in ("--compile", "--no-compile")
    }
    if splits:
        assert steps["--compile"] == pytest.approx(steps["--no-compile"], rel=1e-12)
    else:
        assert steps["--compile"] < 0.9 * steps["--no-compile"]


@pytest.mark.parametrize(
    "where,compiled",
    [
        ("catalog", True),  # a catalog GPU trains with compiled blocks (train.compile = auto on CUDA)
        ("cuda profile", True),
        ("cpu profile", False),  # `shiftlm train` on the CPU runs eagerly
    ],
)
def test_the_default_mode_is_the_trainers_on_that_hardware(where, compiled, tmp_path, capsys):
    cuda_profile = _gpu_profile(tmp_path, eager=2e-4, compiled=1e-4)
    hardware = {
        "catalog": ["--gpu", "h100"],
        "cuda profile": ["--gpu", "this", "--hardware", str(cuda_profile)],
        # written by calibrate's CPU path before profiles named their device type
        "cpu profile": ["--gpu", "this", "--hardware", str(SHIPPED_CPU_PROFILE), "--dtype", "fp32"],
    }[where]
    code, report, _ = _simulate(tmp_path, capsys, hardware)
    assert code == 0 and report["compile"] is compiled
    assert (report["layout"]["pointwise_bytes"] > 0) is not compiled
    _, explicit, _ = _simulate(tmp_path, capsys, hardware, "--compile" if compiled else "--no-compile")
    assert explicit == report


def test_a_profile_without_the_compiled_time_is_simulated_eagerly_with_one_warning(tmp_path, capsys):
    """Where inductor did not build at calibration, `shiftlm train` warns and runs eagerly whether
    compiling was asked for or left to auto: the simulator predicts that step and says so once."""
    profile = _gpu_profile(tmp_path, eager=2e-4)
    hardware = ["--gpu", "this", "--hardware", str(profile)]
    _, eager, _ = _simulate(tmp_path, capsys, hardware, "--no-compile")
    for flags in ((), ("--compile",)):
        code, report, err = _simulate(tmp_path, capsys, hardware, *flags)
        assert code == 0 and report == eager and report["compile"] is False
        assert err.count("\n") == 1 and err.startswith("shiftlm simulate: warning: ")
        assert str(profile) in err and "step_overhead_compiled" in err


def test_a_profile_with_only_the_compiled_time_refuses_eager_in_one_line(tmp_path, capsys):
    profile = _gpu_profile(tmp_path, compiled=1e-4)
    code, _, err = _simulate(tmp_path, capsys, ["--gpu", "this", "--hardware", str(profile)], "--no-compile")
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("shiftlm simulate: error: ") and "step_overhead_eager" in err and "calibrate" in err


def test_plan_train_prices_the_mode_and_writes_it_only_when_asked(tmp_path, capsys):
    from shiftlm.train.config import load_config

    argv = ["plan", "train", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--seq", "4096"]
    argv += ["--global-batch", "16", "--top", "1", "--json"]
    plans = {}
    for flag in ("", "--compile", "--no-compile"):
        out = tmp_path / f"plan{flag}.toml"
        assert main([*argv, *([flag] if flag else []), "--out", str(out)]) == 0
        plans[flag] = json.loads(capsys.readouterr().out)
        written = load_config(out).train.compile
        assert written == {"": "auto", "--compile": "true", "--no-compile": "false"}[flag]
    assert plans[""]["compile"] is plans["--compile"]["compile"] is True  # h100: compiled by default
    assert plans[""]["top"] == plans["--compile"]["top"] and plans["--no-compile"]["compile"] is False
    # eager's pointwise traffic lengthens every step (a catalog GPU's host time is the fitted one in both)
    assert plans["--no-compile"]["top"][0]["step_time_s"] > plans["--compile"]["top"][0]["step_time_s"]
