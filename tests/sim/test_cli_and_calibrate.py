"""CLI contract (one JSON object, exit 2 on bad input) and the calibration fit."""

from __future__ import annotations

import json

import pytest

from shiftlm.cli import main
from shiftlm.sim.calibrate_comm import (
    fit_alpha_beta,
    time_all_reduce,
    time_handoff,
    time_send_recv,
    time_shm_all_reduce,
)


def test_simulate_train_json_is_one_object(capsys):
    code = main(
        [
            "simulate",
            "train",
            "--model",
            "llama3-8b",
            "--gpu",
            "h100",
            "--gpus",
            "8",
            "--tp",
            "2",
            "--pp",
            "2",
            "--global-batch",
            "8",
            "--seq",
            "4096",
            "--json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["layout"]["dp"] == 2 and report["step_time_s"] > 0


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "train", "--model", "no-such-model", "--gpus", "8"],
        ["simulate", "train", "--model", "llama3-8b", "--gpus", "8", "--tp", "3"],
        ["simulate", "train", "--model", "llama3-8b", "--gpus", "8", "--gpu", "tpu-v9"],
        ["simulate", "validate", "--data", "/nonexistent"],
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("shiftlm simulate: error: ") and err.count("\n") == 1


def test_alpha_beta_fit_recovers_latency_and_bandwidth():
    sizes = [2**k for k in range(10, 24)]
    times = [2 * 20e-6 + n / 3e9 for n in sizes]
    latency, bandwidth = fit_alpha_beta(sizes, times)
    assert latency == pytest.approx(20e-6, rel=1e-6) and bandwidth == pytest.approx(3e9, rel=1e-6)


def test_alpha_beta_latency_survives_a_slow_largest_message():
    # a loaded machine: the 16 MiB point runs 1.5x slow; plain least squares lets it set the line
    sizes = [2**k for k in range(10, 25, 2)]
    times = [2 * 20e-6 + n / 3e9 for n in sizes]
    times[-1] *= 1.5
    latency, _ = fit_alpha_beta(sizes, times)
    assert latency == pytest.approx(20e-6, rel=0.1)


def test_all_reduce_timing_runs_on_two_gloo_ranks(ranks):
    per_rank = ranks.run(2, time_all_reduce, [4096, 65536], 2)
    assert len(per_rank) == 2 and all(len(times) == 2 and min(times) > 0 for times in per_rank)


def test_shared_memory_all_reduce_timing_runs_on_two_ranks(ranks):
    """Where the C++ side builds, both ranks time every size through a shared-memory channel; where
    it does not, both say so (None) and calibrate leaves the keys out."""
    per_rank = ranks.run(2, time_shm_all_reduce, [256, 65536], 3)
    assert len(per_rank) == 2
    assert all(times is None for times in per_rank) or all(
        len(times) == 2 and min(times) > 0 for times in per_rank
    )


def test_handoff_timing_runs_on_two_gloo_ranks(ranks):
    sender, receiver = ranks.run(2, time_handoff, 3)
    assert sender == [] and len(receiver) == 3 and all(0 < delay < 5 for delay in receiver)


def test_send_recv_timing_reports_wall_and_process_cpu(ranks):
    for result in ranks.run(2, time_send_recv, [4096, 2**20], 2):
        assert len(result["wall"]) == len(result["cpu"]) == 2
        assert min(result["wall"]) > 0 and result["cpu"][1] > 0


def test_inference_gemm_probe_runs_the_serving_engines_own_linear(monkeypatch):
    """The "inference" role is timed through the function the serving step's `InferenceOps` calls
    (looked up on model.inference_linear when the probe is built), without autograd and with a
    PackedWeights (the weights it multiplies are the packed copies), and computes the same product as
    F.linear."""
    import torch

    import shiftlm.model.inference_linear as inference
    from shiftlm.sim.calibrate import gemm_pass
    from shiftlm.sim.costs import INFERENCE_ROLE

    engine_linear, calls = inference.inference_linear, []

    def spy(x, weight, bias=None, packed=None):
        calls.append((torch.is_grad_enabled(), packed is not None))
        return engine_linear(x, weight, bias, packed)

    monkeypatch.setattr(inference, "inference_linear", spy)
    weights = [torch.randn(64, 32, requires_grad=True) for _ in range(4)]
    biases = [torch.randn(64) for _ in range(4)]
    torch.manual_seed(0)
    outputs = gemm_pass(INFERENCE_ROLE, 16, weights, biases)()
    torch.manual_seed(0)
    x = torch.randn(16, 32)
    assert calls == [(False, True)] * 4
    for out, w, b in zip(outputs, weights, biases):
        assert torch.allclose(out, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
