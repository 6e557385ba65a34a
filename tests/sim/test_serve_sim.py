"""The serving simulator: the real Scheduler in simulated time, a cost-model runner, and plan serve."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shiftlm.serve.engine.scheduler as serve_scheduler
import shiftlm.sim.serve_sim as serve_sim
from shiftlm.cli import main
from shiftlm.data import trace_path
from shiftlm.hardware import CATALOG
from shiftlm.presets import PRESETS
from shiftlm.serve.trace import TraceRequest, load_trace, scale_trace
from shiftlm.sim.efficiency import FITTED
from shiftlm.sim.serve_runner import ServeHardware, ServeLayout
from shiftlm.sim.serve_sim import Slo, simulate_serving

TRACE = trace_path("azure_code")
LLAMA_70B = ServeHardware(PRESETS["llama-3.3-70b"], CATALOG["h100-sxm"], FITTED, "fp8", "bf16")
LLAMA_8B = ServeHardware(PRESETS["llama3-8b"], CATALOG["h100-sxm"], FITTED, "bf16", "bf16")


def _requests(count: int, gap: float, input_len: int = 700, output_len: int = 9) -> list[TraceRequest]:
    """Requests of varied lengths `gap` seconds apart."""
    return [TraceRequest(i * gap, input_len + 131 * (i % 5), output_len + 3 * (i % 4)) for i in range(count)]


def _azure(count: int, rate_scale: float, max_output: int | None = None) -> list[TraceRequest]:
    return scale_trace(
        load_trace(TRACE), max_requests=count, time_scale=1 / rate_scale, max_output=max_output
    )


def test_simulator_steps_the_serving_scheduler_itself(monkeypatch):
    assert serve_sim.Scheduler is serve_scheduler.Scheduler
    calls = []
    real_schedule = serve_scheduler.Scheduler.schedule

    def counting(self):
        calls.append(type(self))
        return real_schedule(self)

    monkeypatch.setattr(serve_scheduler.Scheduler, "schedule", counting)
    run = simulate_serving(LLAMA_8B, ServeLayout(dp=2, tp=1), _requests(12, 0.05))
    assert calls and set(calls) == {serve_scheduler.Scheduler}
    assert len(calls) == run.steps  # every step was planned by the real scheduler


@pytest.mark.parametrize(
    "layout", [ServeLayout(dp=1, tp=2), ServeLayout(dp=2, tp=1), ServeLayout(dp=1, tp=1, sp=2, threshold=64)]
)
def test_every_request_completes_with_causal_timestamps(layout):
    requests = _requests(30, 0.02)
    run = simulate_serving(LLAMA_8B, layout, requests)
    assert len(run.timings) == len(requests)
    for timing in run.timings:
        assert timing.request.arrival < timing.first_token <= timing.finish
    assert run.summary()["requests"] == len(requests)


def test_small_kv_cache_preempts_and_still_completes_everything(monkeypatch):
    # 70B with tp=1 leaves room for ~920 blocks (the engine's own working-set bound,
    # serve/worker/kv_memory.py); 40 concurrent 2k-token requests growing by 200 tokens overflow it
    run = simulate_serving(
        LLAMA_70B, ServeLayout(dp=1, tp=1), _requests(40, 0.0, input_len=2000, output_len=200)
    )
    assert run.preemptions > 0
    assert all(t.finish is not None for t in run.timings)


def _mode_signature(run):
    return (
        run.steps,
        run.steps_per_mode,
        [t.first_token for t in run.timings],
        [t.finish for t in run.timings],
    )


def test_shift_at_threshold_zero_is_sp_tp():
    requests = _requests(20, 0.03)
    shift = simulate_serving(LLAMA_8B, ServeLayout(dp=1, tp=1, sp=4, threshold=0), requests)
    sp_tp = simulate_serving(LLAMA_8B, ServeLayout(dp=1, tp=1, sp=4, threshold=-1), requests)
    assert _mode_signature(shift) == _mode_signature(sp_tp)
    assert shift.mode_switches == 0 and shift.steps_per_mode["tp"] == 0


def test_shift_at_infinite_threshold_is_tp_over_the_same_gpus():
    requests = _requests(20, 0.03)
    shift = simulate_serving(LLAMA_8B, ServeLayout(dp=1, tp=1, sp=4, threshold=math.inf), requests)
    tp = simulate_serving(LLAMA_8B, ServeLayout(dp=1, tp=4), requests)
    assert _mode_signature(shift) == _mode_signature(tp)
    assert shift.steps_per_mode["sp_tp"] == 0


def test_shift_switches_modes_between_prefill_and_decode():
    run = simulate_serving(LLAMA_8B, ServeLayout(dp=1, tp=1, sp=4, threshold=64), _requests(10, 1.0))
    assert run.steps_per_mode["tp"] > 0 and run.steps_per_mode["sp_tp"] > 0
    assert run.mode_switches >= 2 * 10 - 1  # every isolated request: prefill in SP x TP, decode in TP


@settings(max_examples=15, deadline=None)
@given(ttft=st.floats(0.01, 5.0), tpot=st.floats(0.001, 0.2))
def test_goodput_never_exceeds_request_throughput(ttft, tpot):
    run = simulate_serving(LLAMA_8B, ServeLayout(dp=1, tp=2), _requests(15, 0.01), slo=Slo(ttft, tpot))
    summary = run.summary()
    assert summary["goodput_requests_per_s"] <= summary["requests_per_s"]
    assert 0.0 <= summary["slo_attainment"] <= 1.0


def test_tp_decodes_faster_than_sp_tp_at_low_load():
    requests = _azure(40, 0.05)  # requests mostly alone in the engine
    tp = simulate_serving(LLAMA_70B, ServeLayout(dp=1, tp=8), requests).summary()
    sp_tp = simulate_serving(LLAMA_70B, ServeLayout(dp=1, tp=1, sp=8, threshold=-1), requests).summary()
    assert tp["tpot_ms"]["mean"] < sp_tp["tpot_ms"]["mean"]
    assert sp_tp["ttft_ms"]["mean"] < tp["ttft_ms"]["mean"]  # while SP x TP prefills faster


def test_sp_tp_serves_more_tokens_per_second_than_tp_at_high_load():
    # far beyond either layout's capacity; outputs clipped so that no lone long decode at the end
    # (where TP is faster) decides the makespan
    requests = _azure(300, 50.0, max_output=64)
    tp = simulate_serving(LLAMA_70B, ServeLayout(dp=1, tp=8), requests).summary()
    sp_tp = simulate_serving(LLAMA_70B, ServeLayout(dp=1, tp=1, sp=8, threshold=-1), requests).summary()
    assert sp_tp["total_tokens_per_s"] > tp["total_tokens_per_s"]


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


SERVE_ARGS = ("--model", "llama-3.3-70b", "--gpu", "h100", "--gpus", "8", "--trace", str(TRACE))


def test_simulate_serve_json_reports_latency_throughput_and_goodput(capsys):
    code, out, _ = _cli(
        capsys, "simulate", "serve", *SERVE_ARGS, "--mode", "shift", "--max-requests", "30", "--json"
    )
    report = json.loads(out)
    assert code == 0 and report["requests"] == 30
    assert {"mean", "p50", "p90", "p99"} <= report["ttft_ms"].keys()
    assert report["goodput_requests_per_s"] <= report["requests_per_s"]
    assert report["mode_switches"] > 0


def test_plan_serve_suggests_a_layout_that_fits(capsys):
    code, out, _ = _cli(
        capsys, "plan", "serve", *SERVE_ARGS, "--max-requests", "30", "--thresholds", "256", "--json"
    )
    report = json.loads(out)
    assert code == 0 and report["best"]["layout"] == report["ranked"][0]["layout"]
    goodputs = [run["goodput_requests_per_s"] for run in report["ranked"]]
    assert goodputs == sorted(goodputs, reverse=True)


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--mode", "dp", "--tp", "3"), "does not divide"),
        (("--mode", "sp_tp", "--tp", "1", "--dtype", "bf16"), "KV room"),
        (("--mode", "tp", "--rate-scale", "0"), "--rate-scale"),
    ],
)
def test_simulate_serve_bad_input_is_one_line_and_exit_code_2(capsys, extra, message):
    code, out, err = _cli(capsys, "simulate", "serve", *SERVE_ARGS, "--max-requests", "5", *extra)
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1


def test_step_log_records_every_step_with_the_time_the_clock_advanced():
    steps: list[dict] = []
    run = simulate_serving(
        LLAMA_8B, ServeLayout(dp=1, tp=2, sp=2, threshold=64), _requests(6, 0.05), step_log=steps
    )
    assert len(steps) == run.steps and {s["mode"] for s in steps} <= {"tp", "sp_tp"}
    assert all(s["seconds"] > 0 and 1 <= s["chunks"] <= s["tokens"] for s in steps)
    assert sum(s["seconds"] for s in steps) <= max(t.finish for t in run.timings)


def test_serving_steps_take_the_profiles_inference_gemm_rates():
    """A calibrated profile's "inference" rows (the engine's own packed GEMM, `shiftlm calibrate`)
    time the serving step's GEMMs: at twice the training forward's rate a GEMM-bound prefill step
    takes about half as long; a profile without them times the step at the forward's rate."""
    from dataclasses import replace

    from shiftlm.serve.plan import Mode
    from shiftlm.sim.efficiency import MEASURED
    from shiftlm.sim.serve_runner import StepCostModel

    forward = ("forward", 512, 4096, 4096, 1e12)
    plain = replace(CATALOG["h100-sxm"], name="this", gemm_table=(forward,))
    packed = replace(plain, gemm_table=(forward, ("inference", 512, 4096, 4096, 2e12)))
    layout = ServeLayout(dp=1, tp=1, sp=1, threshold=math.inf)

    def step(hardware):
        setup = ServeHardware(PRESETS["llama3-8b"], hardware, MEASURED, "fp32", "fp32")
        return StepCostModel(setup, layout)._dense_time(Mode.TP, 512, 1)

    assert 0.45 < step(packed) / step(plain) < 0.55
