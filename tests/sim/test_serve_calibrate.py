"""Profiling shiftlm's own serving engine (`shiftlm calibrate --serve-model`) and using the profile."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from shiftlm.cli import main
from shiftlm.hardware import CATALOG
from shiftlm.serve.plan import Mode
from shiftlm.serve.trace import TraceRequest
from shiftlm.sim.serve_calibrate import (
    EngineProfile,
    busy_requests,
    engine_setup,
    fit_busy_path,
    fit_loop_gap,
    fit_mode,
    idle_flags,
    profile_engine,
    step_plan,
)
from shiftlm.sim.serve_runner import (
    IDLE_WAKE_S,
    HostOverhead,
    ServeLayout,
    StepCostModel,
    prefill_chunks,
    serving_links,
)
from shiftlm.sim.serve_sim import EngineLimits, simulate_serving

LAYOUT = ServeLayout(dp=1, tp=1, sp=2, threshold=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from shiftlm.serve.engine.tokenizer import write_char_tokenizer
    from shiftlm.tools.tiny import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("engine") / "tiny", "llama-gqa")
    write_char_tokenizer(model_dir, vocab_size=250)
    return model_dir


def _this(tmp_path: Path):
    """A calibrated-style profile (the H100 catalog entry renamed, with an eager-op cost)."""
    return replace(CATALOG["h100-sxm"], name="this", extra={"op_overhead": 2e-6})


def _logged_steps(timed: StepCostModel, sizes, gap: float, gap_per_seq: float, idle_every: int = 0):
    """A step log (start, seconds, tokens, seqs, decodes) of runs of 3 steps alike, back to back with
    the loop gap `gap + gap_per_seq x seqs`; with `idle_every`, every that-many-th step starts 0.2 s
    after the previous one ended (and pays `after_idle`)."""
    steps, clock = [], 0.0
    for index, (tokens, seqs, decodes) in enumerate(size for size in sizes for _ in range(3)):
        idle = index == 0 or (idle_every and index % idle_every == 0)
        clock += 0.2 if idle and index else 0.0
        step = {
            "step": index,
            "mode": "tp",
            "tokens": tokens,
            "seqs": seqs,
            "decodes": decodes,
            "start": clock,
        }
        step["seconds"] = timed.step_time(step_plan(step), idle=bool(idle))
        steps.append(step)
        clock += step["seconds"] + gap + gap_per_seq * seqs
    return steps


SIZES = [(1, 1, 1), (2, 2, 2), (4, 4, 4), (8, 8, 8), (16, 16, 16), (64, 1, 0), (130, 3, 2), (40, 6, 4)]


def test_fit_mode_recovers_the_host_overhead_and_the_loop_gap(tiny, tmp_path):
    """Synthetic step logs made from a known HostOverhead (every term, steps after idle included)
    plus a gap of 0.5 ms + 40 us per sequence between back-to-back steps, and a few steps slowed by
    30 ms (a rank preempted): the fit returns the overhead with the gap folded in, and the slowed
    steps do not move it."""
    setup = engine_setup(tiny, _this(tmp_path))
    truth = HostOverhead(
        per_step=1.2e-3, per_token=15e-6, per_chunk=30e-6, per_prefill=200e-6, after_idle=2e-3
    )
    kernels = StepCostModel(setup, LAYOUT)
    timed = StepCostModel(replace(setup, host={Mode.TP: truth}), LAYOUT)
    steps = _logged_steps(timed, SIZES * 3, 0.5e-3, 40e-6, idle_every=5)
    for slowed in (4, 17, 33):
        steps[slowed]["seconds"] += 30e-3
    fitted = fit_mode(setup, LAYOUT, steps)
    assert fitted.per_step == pytest.approx(truth.per_step + 0.5e-3, rel=1e-3)
    assert fitted.per_chunk == pytest.approx(truth.per_chunk + 40e-6, rel=1e-3)
    for term in ("per_token", "per_prefill", "after_idle"):
        assert getattr(fitted, term) == pytest.approx(getattr(truth, term), rel=1e-3), term
    assert fitted.per_chunk_layer == 0.0
    assert kernels.step_time(step_plan(steps[0])) < timed.step_time(step_plan(steps[0]))
    gap = fit_loop_gap(steps)  # the gap alone, which the profile keeps as `loop_gap`
    assert gap.per_step == pytest.approx(0.5e-3, rel=1e-3) and gap.per_chunk == pytest.approx(40e-6, rel=1e-3)
    assert gap.per_token == gap.after_idle == gap.per_chunk_layer == 0.0


def test_fit_mode_terms_are_never_negative(tiny, tmp_path):
    """Steps whose time falls with the number of sequences (what a least-squares fit turned into a
    negative per-chunk-layer term before): every fitted term stays >= 0."""
    setup = engine_setup(tiny, _this(tmp_path))
    timed = StepCostModel(
        replace(setup, host={Mode.TP: HostOverhead(per_step=3e-3, per_token=10e-6)}), LAYOUT
    )
    steps = _logged_steps(timed, SIZES, 0.3e-3, 0.0)
    for step in steps:
        step["seconds"] -= 100e-6 * step["seqs"]  # no term of the model can be negative
    fitted = fit_mode(setup, LAYOUT, steps)
    assert all(value >= 0.0 for value in vars(fitted).values()) and fitted.per_step > 0


def test_step_plan_follows_the_logged_decode_rows():
    """A log line with `decodes` gives that many one-token chunks and the rest as prompt chunks; an
    older line (no `decodes`) keeps one prompt chunk."""
    plan = step_plan({"step": 0, "mode": "tp", "tokens": 103, "seqs": 5, "decodes": 3})
    assert [len(c.token_ids) for c in plan.chunks] == [1, 1, 1, 50, 50] and prefill_chunks(plan) == 2
    old = step_plan({"step": 0, "mode": "sp_tp", "tokens": 103, "seqs": 5})
    assert [len(c.token_ids) for c in old.chunks] == [1, 1, 1, 1, 99] and prefill_chunks(old) == 1
    assert idle_flags(
        [
            {"start": 0.0, "seconds": 1e-3},
            {"start": 1.5e-3, "seconds": 1e-3},
            {"start": 5e-3, "seconds": 1e-3},
        ]
    ) == [True, False, True]


def test_serving_collectives_take_the_shared_memory_links_a_profile_measured(tiny, tmp_path):
    """A profile with the shared-memory all-reduce (calibrate's `shm_latency`, `shm_bandwidth`) times
    a serving step's collectives with it, not with the gloo links: a full-TP decode step (two
    all-reduces a layer) gets faster by about 4 x 2 x (gloo - shm latency); without the keys the
    step is timed as before."""
    gloo = replace(_this(tmp_path), intra_node_latency=200e-6, inter_node_latency=200e-6)
    shm = replace(gloo, extra={**gloo.extra, "shm_latency": 1e-6, "shm_bandwidth": 10e9})
    assert serving_links(shm, engine_setup(tiny, shm).efficiency).intra_latency == 1e-6
    plan = step_plan({"step": 0, "mode": "tp", "tokens": 1, "seqs": 1})
    full_tp = replace(LAYOUT, threshold=math.inf)
    on_gloo = StepCostModel(engine_setup(tiny, gloo), full_tp).step_time(plan)
    on_shm = StepCostModel(engine_setup(tiny, shm), full_tp).step_time(plan)
    layers = engine_setup(tiny, gloo).model.num_layers
    assert on_gloo - on_shm == pytest.approx(layers * 2 * 2 * (200e-6 - 1e-6), rel=0.05)


def test_idle_threshold_is_the_shared_memory_wait_before_the_futex():
    """`after_idle` is charged after IDLE_WAKE_S because that is when a waiting rank stops yielding
    and sleeps (comm/shm.py's WaitPolicy); the two must move together."""
    from shiftlm.comm.shm import WaitPolicy

    assert IDLE_WAKE_S == WaitPolicy().yield_s


def test_a_step_after_idle_pays_the_wake_up_once(tiny, tmp_path):
    """In `simulate_serving`, the first step after the engine idled (and only it) pays `after_idle`:
    two requests far apart each see it in their TTFT, not in their TPOT, and the step log marks it."""
    setup = engine_setup(tiny, _this(tmp_path))
    host = HostOverhead(per_step=1e-3)
    requests = [TraceRequest(0.0, 40, 4), TraceRequest(1.0, 40, 4)]
    limits = EngineLimits(16, 64, 256, num_blocks=64)
    runs, logs = {}, {}
    for wake in (0.0, 5e-3):
        logs[wake] = []
        timed = replace(setup, host={m: replace(host, after_idle=wake) for m in Mode})
        runs[wake] = simulate_serving(timed, LAYOUT, requests, limits, step_log=logs[wake])
    for cold, warm in zip(runs[5e-3].timings, runs[0.0].timings):
        assert cold.ttft == pytest.approx(warm.ttft + 5e-3) and cold.tpot == pytest.approx(warm.tpot)
    assert [s["idle"] for s in logs[5e-3]] == [True, False, False, False] * 2


def test_engine_profile_round_trips_and_bad_files_name_the_fix(tmp_path):
    profile = EngineProfile("tiny", 1, 2, {"tp": HostOverhead(1e-3, 2e-4, 3e-5)}, 4e-3, 10, "", 6e-3)
    profile.save(tmp_path / "engine.json")
    assert EngineProfile.load(tmp_path / "engine.json") == profile
    fitted = replace(profile, host={"tp": HostOverhead(1e-3, 0.0, 3e-5, 2e-5, 1e-4, 2e-3)})
    fitted.save(tmp_path / "fitted.json")
    assert EngineProfile.load(tmp_path / "fitted.json") == fitted
    # a profile written before the per-chunk, per-prompt-chunk and after-idle terms still loads
    old = {"model": "tiny", "tp": 1, "sp": 2, "per_request": 3e-3, "probe_steps": 9, "notes": ""}
    old["host"] = {"tp": {"per_step": 1e-3, "per_chunk_layer": -5e-5, "per_token": 1e-5}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert EngineProfile.load(tmp_path / "old.json").host["tp"] == HostOverhead(1e-3, -5e-5, 1e-5)
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
    """A small probe set against two real `shiftlm serve` servers (tp=1, sp=2): every fitted term is
    finite and non-negative, a one-sequence decode step has positive host time (a CPU engine's step
    is mostly host work) and the request path outside the engine is positive."""
    hardware = _this(tmp_path)
    probes = (
        [TraceRequest(0.2 * i, length, 1) for i, length in enumerate((8, 48, 96))],
        [TraceRequest(0.0, 8, 6) for _ in range(4)] + [TraceRequest(1.0, 8, 6)],
    )
    load = [TraceRequest(0.1 * i, length, 3) for i, length in enumerate((12, 40, 5))]
    logs = []
    profile = profile_engine(
        tiny, 1, 2, engine_setup(tiny, hardware), ["--num-blocks", "64"], logs.append, 1, probes, load=load
    )
    assert set(profile.host) == {"tp", "sp_tp"} and profile.probe_steps > 10
    one_decode = step_plan({"step": 0, "mode": "tp", "tokens": 1, "seqs": 1})
    for overhead in profile.host.values():
        # the terms are non-negative, so with this small a probe set the split between per step and
        # per chunk is loose (a busy machine can put it all in either): their sum is the claim
        assert overhead.time(one_decode, 2) > 0, profile
        assert all(0 <= v < 1.0 for v in vars(overhead).values()), profile
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
