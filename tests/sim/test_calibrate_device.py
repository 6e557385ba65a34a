"""`calibrate_device`: the CUDA calibration's code path (GEMMs by shape, attention by length, copy
bandwidth, eager and compiled host overheads) run on the CPU, measuring the CPU."""

from __future__ import annotations

import statistics

import pytest
import torch

from shiftlm.hardware import GEMM_ROLES, load_profile, save_profile
from shiftlm.sim.calibrate_device import (
    ATTENTION_SEQS,
    STEP_GEMM_ROWS,
    STEP_GEMM_WIDTHS,
    calibrate_device,
    device_profile,
)


@pytest.fixture(scope="module")
def cpu_profile():
    lines: list[str] = []
    return calibrate_device(torch.device("cpu"), log=lines.append, budget=0.05), lines


def test_every_measurement_is_in_the_profile(cpu_profile, tmp_path):
    hardware, lines = cpu_profile
    shapes = {(m, k, n) for m in STEP_GEMM_ROWS["cpu"] for k, n in STEP_GEMM_WIDTHS["cpu"]}
    assert {(row[0], *row[1:4]) for row in hardware.gemm_table} == {
        (r, *s) for r in GEMM_ROLES for s in shapes
    }
    assert all(row[4] > 0 for row in hardware.gemm_table)
    forward = [row[4] for row in hardware.gemm_table if row[0] == "forward"]
    assert hardware.peak_flops["fp32"] == statistics.median(forward)
    for seq in ATTENTION_SEQS["cpu"]:
        assert hardware.extra[f"attention_fwd_{seq}"] > 0 and hardware.extra[f"attention_bwd_{seq}"] > 0
    assert hardware.hbm_bandwidth > 1e8 and hardware.extra["op_overhead"] > 0
    # a compiled block's host time per layer is measured beside the eager one (inductor builds here)
    assert hardware.extra["step_overhead_eager"] > 0 and hardware.extra["step_overhead_compiled"] > 0
    assert "catalog_gemm_ratio" not in hardware.extra  # a CPU has no catalog entry to check
    assert hardware.device_type == "cpu"  # `simulate train` then defaults to eager, as the trainer runs
    assert any("attention at 256 tokens" in line for line in lines)
    path = tmp_path / "hardware.json"
    save_profile(hardware, path)
    assert load_profile(path) == hardware


def test_no_compiled_time_where_the_compiled_blocks_ran_eagerly(monkeypatch):
    """A build failure inductor's up-front check missed turns every block eager (`CompiledBlock.broken`):
    the step timed then is an eager one, so no compiled time is written (`simulate train` warns)."""
    from shiftlm.model.compile import CompiledBlock
    from shiftlm.sim.calibrate_device import _step_overheads

    monkeypatch.setattr(CompiledBlock, "broken", "inductor failed")
    assert set(_step_overheads(torch.device("cpu"), budget=0.01)) == {"step_overhead_eager"}


def test_a_catalog_gpu_is_checked_against_the_catalog():
    """What a GPU's run reports: the measured peak and bandwidth over the catalog's H100 entry."""
    measured = {
        "gemm": {("forward", 8192, 2048, 2048): 7.0e14, ("dgrad", 8192, 2048, 2048): 6.0e14},
        "attention": {2048: (3.0e14, 2.5e14)},
        "memory": 2.9e12,
        "op": 5e-6,
        "step_overhead_eager": 4e-4,
        "step_overhead_compiled": 1e-4,
    }
    hardware = device_profile(measured, "NVIDIA H100 80GB HBM3", 80e9, 1, "bf16")
    assert hardware.peak_flops["bf16"] == 7.0e14
    assert hardware.extra["catalog_gemm_ratio"] == pytest.approx(7.0e14 / (989e12 * 0.803))
    assert hardware.extra["catalog_hbm_ratio"] == pytest.approx(2.9e12 / 3350e9)
    assert hardware.intra_node_bandwidth == 450e9  # links from the catalog: one GPU measures none
    assert hardware.attention_fraction == pytest.approx(3.0e14 / 7.0e14)
    assert hardware.device_type == "cuda"


def test_a_gpu_profile_drives_simulate_train(tmp_path):
    """`shiftlm simulate train --gpu this` runs on what `calibrate_device` writes for a GPU."""
    import json
    import os
    import subprocess
    import sys

    from shiftlm.config import ModelConfig

    measured = {
        "gemm": {(role, 8192, 2048, 2048): 6.5e14 for role in GEMM_ROLES},
        "attention": {2048: (3.0e14, 2.5e14)},
        "memory": 4.2e12,
        "op": 5e-6,
    }
    profile = tmp_path / "hardware.json"
    save_profile(device_profile(measured, "NVIDIA H200", 141e9, 1, "bf16"), profile)
    model = tmp_path / "config.json"
    model.write_text(json.dumps(ModelConfig(num_layers=2).to_hf_dict()))
    command = [
        sys.executable,
        "-m",
        "shiftlm",
        "simulate",
        "train",
        "--gpu",
        "this",
        "--hardware",
        str(profile),
    ]
    command += [
        "--model",
        str(model),
        "--seq",
        "512",
        "--global-batch",
        "4",
        "--micro-batch",
        "4",
        "--gpus",
        "1",
    ]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    run = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["step_time_s"] > 0
