"""`shiftlm calibrate --serve-model DIR`: profile the serving engine on this machine, so the serving
simulator can predict shiftlm's own servers here (Vidur, Agrawal et al. 2024, profiles an engine's
operators per model the same way before simulating traces).

A CPU engine's step is mostly host work that no kernel model sees: Python and autograd-free eager
dispatch per layer, the plan's encode and broadcast and the logits gather, the wake-up of ranks that
slept while the engine idled, then the engine loop's sampling and scheduling between steps, and around every
request the HTTP, tokenizing and streaming path. All three are measured with *probes*, never with
the trace the simulator will replay:

1. One real server per step mode (`shiftlm serve --mode tp|sp_tp --step-log`), started as users
   start it, on the layout asked for; PROBE_ROUNDS rounds alternate the servers.
2. Prefill probes: one request at a time (nothing else in flight), prompts of PREFILL_LENGTHS tokens,
   one output token. Decode probes: B requests sent together (B in DECODE_BATCHES), 8-token prompts,
   DECODE_TOKENS outputs each, so the engine runs back-to-back steps of B sequences. Busy probes:
   prompts sent while a background batch decodes. Load probes: open-loop Poisson arrivals at
   LOAD_RATES with synthetic lengths (`load_requests`, no trace's), which put the engine in the
   state a sparse trace does: steps after idle, short runs of decodes, prompts joining them.
3. Fits, per mode, on the probes' step log:
   - the step's execution residual over the kernel cost model (`StepCostModel` on the calibrated
     hardware profile) as `HostOverhead` terms with a physical meaning (per step, per sequence
     chunk, per prompt chunk, per token, and once after the engine idled: the ranks asleep on the
     shared-memory futex), by non-negative least squares, steps slowed by preemption left out;
   - the engine loop's gap between back-to-back steps (sample, stream the tokens, schedule) on
     [1, sequences], the same way, folded into the same HostOverhead and kept alone as `loop_gap`;
   `per_request`: a prefill probe's client-side TTFT minus its logged step (median over probes);
   and `per_request_busy`, the same path while the engine steps (the HTTP side shares the host and
   rank 0's interpreter with the engine loop), fitted by replaying the busy probes' workload in
   `simulate_serving` until its mean TTFT equals the measured one.

The result is an `EngineProfile` JSON (`--engine-out`), which `simulate serve --engine-profile`
and bench/serve_sim_vs_measured.py load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from shiftlm.config import ModelConfig
from shiftlm.hardware import Hardware
from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan
from shiftlm.serve.trace import TraceRequest
from shiftlm.sim.efficiency import measured
from shiftlm.sim.serve_runner import (
    IDLE_WAKE_S,
    HostOverhead,
    ServeHardware,
    ServeLayout,
    StepCostModel,
    prefill_chunks,
)
from shiftlm.sim.serve_sim import EngineLimits, simulate_serving

PREFILL_LENGTHS = (4, 16, 48, 96, 160, 224)
PREFILL_REPEATS = 3
DECODE_BATCHES = (1, 2, 4, 8, 16)
DECODE_TOKENS = 12
PROBE_SPACING_S = 0.25  # between isolated prefill probes
BUSY_GAP_S = 0.05  # a step that starts within this of the previous one's end ran back-to-back
PROBE_ROUNDS = 4  # passes over the probes, alternating the servers
BUSY_BACKGROUND, BUSY_BACKGROUND_TOKENS, BUSY_PROMPTS = 6, 40, (16, 48, 96, 160, 48, 96)
# load probes: open-loop arrivals at these rates (requests/s), LOAD_REQUESTS at each, prompts of
# 4-224 tokens (log-uniform), 1-16 output tokens: the engine in the state a sparse trace puts it in
LOAD_RATES, LOAD_REQUESTS, LOAD_SEED = (3.0, 8.0), 20, 17
OUTLIER_MADS = 6.0  # a step this many robust standard deviations slower than the fit is left out


@dataclass(frozen=True)
class EngineProfile:
    """What `shiftlm calibrate --serve-model` measured for one model and layout on this machine."""

    model: str
    tp: int
    sp: int
    host: dict[str, HostOverhead]  # by step mode: execution residual + engine-loop gap
    per_request: float  # seconds of a request's path outside the engine (HTTP, tokenize, stream)
    probe_steps: int
    notes: str = ""
    per_request_busy: float | None = None  # the same path while the engine steps (None: as idle)
    # by step mode, the part of `host` that is the engine loop's gap after a step (schedule, sample,
    # hand outputs over): a logged step's own execution is the step time less this (None: not kept)
    loop_gap: dict[str, HostOverhead] | None = None

    def apply(self, setup: ServeHardware) -> ServeHardware:
        """`setup` with this engine's host overheads per mode and its request path."""
        host = {Mode(mode): overhead for mode, overhead in self.host.items()}
        return replace(setup, host=host, per_request=self.per_request, per_request_busy=self.per_request_busy)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> EngineProfile:
        if not path.exists():
            raise ValueError(
                f"no engine profile at {path}; run `shiftlm calibrate --serve-model DIR --engine-out {path}`"
            )
        try:
            fields = json.loads(path.read_text())
            fields["host"] = {mode: HostOverhead(**h) for mode, h in fields["host"].items()}
            if fields.get("loop_gap") is not None:
                fields["loop_gap"] = {mode: HostOverhead(**h) for mode, h in fields["loop_gap"].items()}
            return cls(**fields)
        except (json.JSONDecodeError, TypeError, KeyError) as err:
            raise ValueError(f"{path} is not an engine profile ({err}); re-run `shiftlm calibrate`") from err


def engine_setup(model_dir: Path, hardware: Hardware, profile: EngineProfile | None = None) -> ServeHardware:
    """The CPU engine as the cost model sees it: the checkpoint's shapes, fp32 weights and cache, the
    calibrated kernel rates plus one eager op per kernel, and (with `profile`) the engine's measured
    host overheads and request path."""
    setup = ServeHardware(ModelConfig.from_hf(model_dir), hardware, measured(hardware.extra), "fp32", "fp32")
    return profile.apply(setup) if profile is not None else setup


def step_plan(step: dict, context: int = 100) -> StepPlan:
    """The plan of a step-log line: its `decodes` one-token chunks (`context` tokens of context) and
    the rest of its sequences as prompt chunks sharing the rest of the tokens evenly (a log without
    `decodes`: every sequence but one decodes when the step has more tokens than sequences)."""
    seqs, tokens = step["seqs"], step["tokens"]
    decodes = step.get("decodes", seqs if tokens == seqs else seqs - 1)
    chunks = [ScheduledChunk(i, (5,), context, (), True) for i in range(decodes)]
    prompts = seqs - decodes
    for j in range(prompts):
        length = (tokens - decodes) // prompts + (j < (tokens - decodes) % prompts)
        chunks.append(ScheduledChunk(decodes + j, (5,) * length, 0, (), True))
    return StepPlan(step["step"], Mode(step["mode"]), tuple(chunks))


def idle_flags(steps: list[dict]) -> list[bool]:
    """Whether each logged step started after the engine idled (at least IDLE_WAKE_S since the
    previous step ended; the first step of a log did)."""
    flags, end = [], -math.inf
    for step in steps:
        flags.append(step["start"] - end >= IDLE_WAKE_S)
        end = step["start"] + step["seconds"]
    return flags


def _nonnegative_fit(rows: list[list[float]], targets: list[float]) -> list[float]:
    """Non-negative least squares, robust to a loaded host: after a first fit, the steps whose
    residual is more than OUTLIER_MADS robust standard deviations above the median residual (a rank
    preempted by another process for a scheduler slice or more) are left out and the fit repeated."""
    a, b = np.array(rows, dtype=float), np.array(targets, dtype=float)
    keep = np.ones(len(b), dtype=bool)
    for _ in range(2):
        solution = nnls(a[keep], b[keep])[0]
        residual = b - a @ solution
        center = np.median(residual[keep])
        spread = 1.4826 * np.median(np.abs(residual[keep] - center))
        keep = residual <= center + OUTLIER_MADS * max(spread, 1e-9)
    return [float(x) for x in nnls(a[keep], b[keep])[0]]


def fit_mode(setup: ServeHardware, layout: ServeLayout, steps: list[dict]) -> HostOverhead:
    """HostOverhead of one mode from its probe steps (`start`, `seconds`, `tokens`, `seqs`, and
    `decodes` where logged): the execution's residual over the kernel model on [1, chunks, prompt
    chunks, tokens, after idle] by non-negative least squares, plus the engine loop's gap between
    back-to-back steps (`fit_loop_gap`)."""
    cost = StepCostModel(replace(setup, host=None), layout)  # the plan names the mode
    plans = [step_plan(s) for s in steps]
    per_step, per_chunk, per_prefill, per_token, after_idle = _nonnegative_fit(
        [
            [1.0, len(p.chunks), prefill_chunks(p), p.num_tokens, float(idle)]
            for p, idle in zip(plans, idle_flags(steps))
        ],
        [s["seconds"] - cost.step_time(p) for s, p in zip(steps, plans)],
    )
    execution = HostOverhead(
        per_step=per_step,
        per_token=per_token,
        per_chunk=per_chunk,
        per_prefill=per_prefill,
        after_idle=after_idle,
    )
    return execution + fit_loop_gap(steps)


def fit_loop_gap(steps: list[dict]) -> HostOverhead:
    """The engine loop's gap between back-to-back steps of the same sequences (sampling, streaming
    the tokens, scheduling the next step), on [1, chunks], non-negative."""
    plans = [step_plan(s) for s in steps]
    gaps = [
        (len(p.chunks), nxt["start"] - (s["start"] + s["seconds"]))
        for s, p, nxt in zip(steps, plans, steps[1:])
        if 0 <= nxt["start"] - (s["start"] + s["seconds"]) < BUSY_GAP_S and nxt["seqs"] == s["seqs"]
    ]
    if len(gaps) < 2:
        return HostOverhead()
    gap_step, gap_chunk = _nonnegative_fit([[1.0, c] for c, _ in gaps], [g for _, g in gaps])
    return HostOverhead(per_step=gap_step, per_chunk=gap_chunk)


def busy_requests() -> tuple[list[TraceRequest], int]:
    """Prompts sent while the engine is busy decoding a background batch: (requests, how many of
    them, first in the list, are the background)."""
    background = [TraceRequest(0.0, 8, BUSY_BACKGROUND_TOKENS) for _ in range(BUSY_BACKGROUND)]
    probes = [TraceRequest(0.05 + 0.07 * i, length, 1) for i, length in enumerate(BUSY_PROMPTS)]
    return background + probes, len(background)


def load_requests(
    rates: tuple[float, ...] = LOAD_RATES, per_rate: int = LOAD_REQUESTS, seed: int = LOAD_SEED
) -> list[TraceRequest]:
    """Poisson arrivals at each rate in turn (1 s apart), synthetic lengths: not any trace's."""
    rng = np.random.default_rng(seed)
    requests, start = [], 0.0
    for rate in rates:
        arrivals = start + np.cumsum(rng.exponential(1.0 / rate, per_rate))
        prompts = np.exp(rng.uniform(math.log(4), math.log(224), per_rate)).astype(int)
        outputs = rng.integers(1, 17, per_rate)
        requests += [TraceRequest(float(t), int(p), int(o)) for t, p, o in zip(arrivals, prompts, outputs)]
        start = float(arrivals[-1]) + 1.0
    return requests


def probe_requests() -> tuple[list[TraceRequest], list[TraceRequest]]:
    """Isolated prefill probes, and decode probes (batches sent together, far apart)."""
    prefill = [
        TraceRequest(PROBE_SPACING_S * i, length, 1)
        for i, length in enumerate(length for _ in range(PREFILL_REPEATS) for length in PREFILL_LENGTHS)
    ]
    decode, start = [], 0.0
    for batch in DECODE_BATCHES:
        decode += [TraceRequest(start, 8, DECODE_TOKENS) for _ in range(batch)]
        start += 0.4 + 0.02 * batch  # > the batch's ~DECODE_TOKENS steps: groups never overlap
    return prefill, decode


def fit_busy_path(
    setup: ServeHardware,
    layout: ServeLayout,
    host: dict[str, HostOverhead],
    per_request: float,
    busy: list[TraceRequest],
    background: int,
    measured: dict[str, list[float]],
) -> float:
    """The request path while the engine steps: the value that makes the simulated mean TTFT of the
    busy probes (the same workload, replayed by `simulate_serving` with the fitted host work) equal
    the measured one. TTFT moves one for one with it, so a few corrections converge."""
    weights = {mode: len(measured[mode]) for mode in host if measured[mode]}
    if not weights:
        return per_request
    timed = replace(
        setup, host={Mode(mode): overhead for mode, overhead in host.items()}, per_request=per_request
    )
    limits = EngineLimits(block_size=16, max_num_seqs=64, max_tokens_per_step=256, num_blocks=512)
    path = per_request
    for _ in range(4):
        shortfall = 0.0  # measured - simulated mean TTFT of the probes, weighted by probes per mode
        for mode, count in weights.items():
            threshold = math.inf if mode == "tp" else -1
            run = simulate_serving(
                replace(timed, per_request_busy=path), replace(layout, threshold=threshold), busy, limits
            )
            simulated = statistics.fmean(t.ttft for t in run.timings[background:])
            shortfall += count * (statistics.fmean(measured[mode]) - simulated)
        path = max(0.0, path + shortfall / sum(weights.values()))
    return path


def _read_steps(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def profile_engine(
    model_dir: Path,
    tp: int,
    sp: int,
    setup: ServeHardware,
    serve_args: list[str] = (),
    log: Callable[[str], None] = print,
    rounds: int = PROBE_ROUNDS,
    probes: tuple[list[TraceRequest], list[TraceRequest]] | None = None,
    step_log_dir: Path | None = None,
    load: list[TraceRequest] | None = None,
) -> EngineProfile:
    """Start one server per mode on `model_dir` (tp x sp ranks), run the probes `rounds` times,
    alternating the servers so that load elsewhere on the machine falls on both, and fit (module doc).
    `probes`: (prefill, decode) probes instead of `probe_requests()`; `load`: the load probes instead
    of `load_requests()`. `step_log_dir`: keep each server's step log there (steps_MODE.jsonl, warm-up
    included) and probes.json, the step numbers [first, end) of every probe replay by mode."""
    from shiftlm.serve.local_server import local_server
    from shiftlm.serve.replay import bench_url, steps_so_far

    replay_args = argparse.Namespace(model_name=None, timeout=300.0, slo_ttft=10.0, slo_tpot=10.0)
    prefill, decode = probes or probe_requests()
    load = load_requests() if load is None else load
    layout = ServeLayout(dp=1, tp=tp, sp=sp, threshold=0)  # every logged plan names its mode
    modes = ("tp", "sp_tp") if sp > 1 else ("tp",)  # without SP there is one mode
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as servers:
        logs = {mode: Path(tmp) / f"steps_{mode}.jsonl" for mode in modes}
        urls = {}
        for mode in modes:
            argv = ["--model", str(model_dir), "--tp", str(tp), "--sp", str(sp), "--mode", mode]
            urls[mode] = servers.enter_context(
                local_server([*argv, "--step-log", str(logs[mode]), *serve_args])
            ).url
        first, prefill_results, busy_results = {}, {mode: [] for mode in modes}, {mode: [] for mode in modes}
        busy, background = busy_requests()
        for mode in modes:
            bench_url(urls[mode], decode[:4], replay_args, first_id=200)  # warm-up, discarded
            first[mode] = steps_so_far(urls[mode])
        spans: dict[str, list[tuple[str, int, int]]] = {mode: [] for mode in modes}

        def replay(mode: str, kind: str, requests: list[TraceRequest], first_id: int) -> list:
            if not requests:
                return []
            before = steps_so_far(urls[mode])
            results = bench_url(urls[mode], requests, replay_args, first_id=first_id)[1]
            spans[mode].append((kind, before, steps_so_far(urls[mode])))
            return results

        for round_ in range(rounds):
            for mode in modes[round_ % 2 :] + modes[: round_ % 2]:
                prefill_results[mode] += replay(mode, "prefill", prefill, 3 + 40 * round_)
                replay(mode, "decode", decode, 23 + 40 * round_)
                results = replay(mode, "busy", busy, 33 + 40 * round_)
                busy_results[mode] += [r.ttft for r in results[background:] if r.ok]
                replay(mode, "load", load, 13 + 40 * round_)
        servers.close()  # flushes the step logs
        if step_log_dir is not None:
            step_log_dir.mkdir(parents=True, exist_ok=True)
            for mode in modes:
                (step_log_dir / logs[mode].name).write_text(logs[mode].read_text())
            (step_log_dir / "probes.json").write_text(json.dumps(spans, indent=1) + "\n")
        steps = {mode: [s for s in _read_steps(logs[mode]) if s["step"] >= first[mode]] for mode in modes}
    host, request_overheads = {}, []
    for mode in modes:
        host[mode] = fit_mode(setup, layout, steps[mode])
        # a prefill probe's TTFT = the request path + its step (+ the loop's gap after it); the step
        # is the one the engine logged (a lone prompt of that length), not the fit's estimate of it:
        # the fit's residual on one step kind is not the request path (it made it negative at tp2)
        costed = StepCostModel(replace(setup, host={Mode(mode): host[mode]}), layout)
        lone_prompts: dict[int, list[float]] = {}
        for step in steps[mode]:
            if step["seqs"] == 1 and step["tokens"] > 1:
                lone_prompts.setdefault(step["tokens"], []).append(step["seconds"])
        for result in prefill_results[mode]:
            if result.ok:
                logged = lone_prompts.get(result.input_len)
                plan = step_plan({"step": 0, "mode": mode, "tokens": result.input_len, "seqs": 1})
                step_seconds = statistics.median(logged) if logged else costed.step_time(plan)
                request_overheads.append(result.ttft - step_seconds)
        h = host[mode]
        log(
            f"calibrate: engine {mode:5s} ({len(steps[mode])} probe steps): per step {h.per_step * 1e3:.2f} ms, "
            f"per chunk {h.per_chunk * 1e6:.0f} us, per prompt chunk {h.per_prefill * 1e6:.0f} us, per token "
            f"{h.per_token * 1e6:.1f} us, after idle {h.after_idle * 1e3:.2f} ms (loop gap included)"
        )
    per_request = statistics.median(request_overheads) if request_overheads else 0.0
    log(
        f"calibrate: request path outside the engine: {per_request * 1e3:.2f} ms (median of {len(request_overheads)})"
    )
    per_request_busy = fit_busy_path(setup, layout, host, per_request, busy, background, busy_results)
    log(f"calibrate: request path while the engine steps: {per_request_busy * 1e3:.2f} ms")
    return EngineProfile(
        model=str(model_dir),
        tp=tp,
        sp=sp,
        host=host,
        per_request=per_request,
        per_request_busy=per_request_busy,
        loop_gap={mode: fit_loop_gap(steps[mode]) for mode in modes},
        probe_steps=sum(len(s) for s in steps.values()),
        notes=f"shiftlm calibrate --serve-model on {setup.hardware.name}, {rounds} probe rounds",
    )
