"""Profiling shiftlm's own serving engine (`shiftlm calibrate --serve-model`) and using the profile."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from shiftlm.cli import main
from shiftlm.hardware import CATALOG
from shiftlm.serve.scheduler import Mode
from shiftlm.serve.trace import TraceRequest
from shiftlm.sim.serve_calibrate import (
    EngineProfile,
    busy_requests,
    engine_setup,
    fit_busy_path,
    fit_loop_gap,
    fit_mode,
    profile_engine,
    step_plan,
)
from shiftlm.sim.serve_runner import HostOverhead, ServeLayout, StepCostModel
from shiftlm.sim.serve_sim import EngineLimits, simulate_serving

LAYOUT = ServeLayout(dp=1, tp=1, sp=2, threshold=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from shiftlm.model.tiny import make_tiny_checkpoint
    from shiftlm.serve.tokenizer import write_char_tokenizer

    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("engine") / "tiny", "llama-gqa")
    write_char_tokenizer(model_dir, vocab_size=250)
    return model_dir


def _this(tmp_path: Path):
    """A calibrated-style profile (the H100 catalog entry renamed, with an eager-op cost)."""
    return replace(CATALOG["h100-sxm"], name="this", extra={"op_overhead": 2e-6})


def test_fit_mode_recovers_the_host_overhead_and_the_loop_gap(tiny, tmp_path):
    """Synthetic step logs made from a known HostOverhead plus a gap of 0.5 ms + 40 us per sequence
    between back-to-back steps: the fit returns the overhead with the gap folded in."""
    setup = engine_setup(tiny, _this(tmp_path))
    truth = HostOverhead(per_step=6e-3, per_chunk_layer=150e-6, per_token=20e-6)
    kernels = StepCostModel(setup, LAYOUT)
    timed = StepCostModel(replace(setup, host={Mode.TP: truth}), LAYOUT)
    steps, clock = [], 0.0
    sizes = [(1, 1), (2, 2), (4, 4), (8, 8), (16, 16), (64, 1), (130, 3)]
    for index, (tokens, seqs) in enumerate(size for size in sizes for _ in range(3)):  # runs of 3 alike
        step = {"step": index, "mode": "tp", "tokens": tokens, "seqs": seqs, "start": clock}
        step["seconds"] = timed.step_time(step_plan(step))
        steps.append(step)
        clock += step["seconds"] + 0.5e-3 + 40e-6 * seqs
    fitted = fit_mode(setup, LAYOUT, steps)
    layers = setup.model.num_layers
    assert fitted.per_step == pytest.approx(truth.per_step + 0.5e-3, rel=1e-6)
    assert fitted.per_chunk_layer == pytest.approx(truth.per_chunk_layer + 40e-6 / layers, rel=1e-6)
    assert fitted.per_token == pytest.approx(truth.per_token, rel=1e-6)
    assert kernels.step_time(step_plan(steps[0])) < timed.step_time(step_plan(steps[0]))
    gap = fit_loop_gap(steps, layers)  # the gap alone, which the profile keeps as `loop_gap`
    assert gap.per_step == pytest.approx(0.5e-3, rel=1e-6) and gap.per_token == 0.0
    assert gap.per_chunk_layer == pytest.approx(40e-6 / layers, rel=1e-6)


def test_engine_profile_round_trips_and_bad_files_name_the_fix(tmp_path):
    profile = EngineProfile("tiny", 1, 2, {"tp": HostOverhead(1e-3, 2e-4, 3e-5)}, 4e-3, 10, "", 6e-3)
    profile.save(tmp_path / "engine.json")
    assert EngineProfile.load(tmp_path / "engine.json") == profile
    with_gap = replace(profile, loop_gap={"tp": HostOverhead(5e-4, 2e-6, 0.0)})
    with_gap.save(tmp_path / "gap.json")
    assert EngineProfile.load(tmp_path / "gap.json") == with_gap
    with pytest.raises(ValueError, match="shiftlm calibrate --serve-model"):
        EngineProfile.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text(json.dumps({"model": "x"}))
    with pytest.raises(ValueError, match="not an engine profile"):
        EngineProfile.load(tmp_path / "bad.json")


def test_request_path_delays_the_first_token_of_an_idle_engine_by_exactly_itself(tiny, tmp_path):
    setup = engine_setup(tiny, _this(tmp_path))
    requests = [TraceRequest(0.0, 40, 4), TraceRequest(1.0, 40, 4)]
    limits = EngineLimits(16, 64, 256, num_blocks=64)
    plain = simulate_serving(setup, LAYOUT, requests, limits)
    delayed = simulate_serving(replace(setup, per_request=5e-3), LAYOUT, requests, limits)
    for before, after in zip(plain.timings, delayed.timings):
        assert after.ttft == pytest.approx(before.ttft + 5e-3) and after.tpot == pytest.approx(before.tpot)
    assert delayed.kv_blocks_per_replica == 64  # the engine's configured cache, not the memory model's


def test_profile_engine_probes_real_servers_and_fits_both_modes(tiny, tmp_path):
    """A small probe set against two real `shiftlm serve` servers (tp=1, sp=2 on gloo): every fitted
    term is finite, the per-step host time is positive (a CPU engine's step is mostly host work) and
    the request path outside the engine is positive."""
    hardware = _this(tmp_path)
    probes = (
        [TraceRequest(0.2 * i, length, 1) for i, length in enumerate((8, 48, 96))],
        [TraceRequest(0.0, 8, 6) for _ in range(4)] + [TraceRequest(1.0, 8, 6)],
    )
    logs = []
    profile = profile_engine(
        tiny, 1, 2, engine_setup(tiny, hardware), ["--num-blocks", "64"], logs.append, 1, probes
    )
    assert set(profile.host) == {"tp", "sp_tp"} and profile.probe_steps > 10
    for overhead in profile.host.values():
        assert overhead.per_step > 0 and all(abs(v) < 1.0 for v in vars(overhead).values())
    assert 0 < profile.per_request < 1.0 and 0 <= profile.per_request_busy < 1.0
    assert any("request path" in line for line in logs)


def test_simulate_serve_takes_an_engine_profile(tiny, tmp_path, capsys):
    from shiftlm.hardware import save_profile

    save_profile(_this(tmp_path), tmp_path / "this.json")
    EngineProfile("tiny", 1, 2, {m: HostOverhead(5e-3, 1e-4, 2e-5) for m in ("tp", "sp_tp")}, 4e-3, 1).save(
        tmp_path / "engine.json"
    )
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": i * 100, "input_length": 30, "output_length": 5}) + "\n"
            for i in range(6)
        )
    )
    argv = ["simulate", "serve", "--model", str(tiny / "config.json"), "--gpu", "this", "--hardware"]
    argv += [str(tmp_path / "this.json"), "--gpus", "2", "--mode", "shift", "--tp", "1", "--dtype", "fp32"]
    argv += ["--kv-dtype", "fp32", "--trace", str(trace), "--num-blocks", "64", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*argv, "--engine-profile", str(tmp_path / "engine.json")]) == 0
    profiled = json.loads(capsys.readouterr().out)
    assert profiled["ttft_ms"]["mean"] > plain["ttft_ms"]["mean"] + 4  # 4 ms request path + host work


def test_busy_request_path_applies_only_while_the_engine_steps(tiny, tmp_path):
    """A request that arrives while the engine is stepping takes the busy path; one that arrives at
    an idle engine the idle path."""
    setup = replace(engine_setup(tiny, _this(tmp_path)), per_request=2e-3)
    alone = [TraceRequest(0.0, 40, 3)]
    during = [TraceRequest(0.0, 8, 400), TraceRequest(0.01, 40, 3)]
    limits = EngineLimits(16, 64, 256, num_blocks=64)
    slow = replace(setup, per_request_busy=9e-3)
    assert simulate_serving(slow, LAYOUT, alone, limits).timings[0].ttft == pytest.approx(
        simulate_serving(setup, LAYOUT, alone, limits).timings[0].ttft
    )
    assert simulate_serving(slow, LAYOUT, during, limits).timings[1].ttft > (
        simulate_serving(setup, LAYOUT, during, limits).timings[1].ttft + 5e-3
    )


def test_busy_path_fit_reproduces_the_measured_ttfts(tiny, tmp_path):
    """TTFTs simulated with a 9 ms busy path stand for the measurement; the fit, started from the
    idle 2 ms, returns a path whose simulated TTFTs match them (TTFT is a step function of the path
    where admissions cross step boundaries, so the path itself is identified only up to that)."""
    setup = engine_setup(tiny, _this(tmp_path))
    host = {mode: HostOverhead(5e-3, 1e-4, 2e-5) for mode in ("tp", "sp_tp")}
    busy, background = busy_requests()
    limits = EngineLimits(16, 64, 256, num_blocks=512)

    def ttfts(path: float) -> dict[str, list[float]]:
        timed = replace(
            setup, host={Mode(m): h for m, h in host.items()}, per_request=2e-3, per_request_busy=path
        )
        return {
            mode: [
                t.ttft
                for t in simulate_serving(timed, replace(LAYOUT, threshold=threshold), busy, limits).timings[
                    background:
                ]
            ]
            for mode, threshold in (("tp", math.inf), ("sp_tp", -1))
        }

    measured = ttfts(9e-3)
    fitted = fit_busy_path(setup, LAYOUT, host, 2e-3, busy, background, measured)
    assert fitted == pytest.approx(9e-3, abs=1e-3)
    for mode, values in ttfts(fitted).items():
        assert sum(values) == pytest.approx(sum(measured[mode]), rel=0.01)
