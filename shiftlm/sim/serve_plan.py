"""Serving layouts on N GPUs, and `plan serve`: simulate each on the trace, rank by goodput.

A layout is DP x TP (independent replicas), SP x TP (Ulysses over tokens, TP inside), or shift
(SP x TP weights, full TP over the same GPUs for steps of <= threshold tokens; Hidayetoglu et al.
2025). Pure TP is DP x TP with one replica. Layouts whose weights leave no KV room for the longest
request are dropped; the rest are ranked by goodput under the SLOs, ties broken by mean E2E latency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shiftlm.errors import ConfigError
from shiftlm.serve.trace import TraceRequest
from shiftlm.sim.capabilities import SERVE_DATA_PARALLEL
from shiftlm.sim.serve_runner import ServeHardware, ServeLayout
from shiftlm.sim.serve_sim import (
    DEFAULT_LIMITS,
    DEFAULT_SLO,
    EngineLimits,
    ServeRun,
    Slo,
    scheduler_config,
    simulate_serving,
)

MODES = ("tp", "dp", "sp_tp", "shift")
DEFAULT_THRESHOLDS = (64, 256, 1024, 4096)


def tp_degrees(setup: ServeHardware, gpus: int) -> list[int]:
    """TP degrees that divide the GPUs, the heads and (or are divided by) the KV heads."""
    model = setup.model
    return [
        tp
        for tp in (2**i for i in range(int(math.log2(gpus)) + 1))
        if gpus % tp == 0
        and model.num_heads % tp == 0
        and (model.num_kv_heads % tp == 0 or tp % model.num_kv_heads == 0)
    ]


def layout_for(mode: str, gpus: int, tp: int, threshold: float = 256) -> ServeLayout:
    """The layout `--mode` names: tp = one replica over every GPU; dp = gpus/tp replicas; sp_tp and
    shift = sp = gpus/tp, with the shift threshold in scheduled tokens per step."""
    if mode not in MODES:
        raise ValueError(f"unknown --mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "tp":
        return ServeLayout(dp=1, tp=gpus)
    if tp < 1 or gpus % tp:
        valid = ", ".join(str(d) for d in range(1, gpus + 1) if gpus % d == 0)
        raise ValueError(f"--tp {tp} does not divide --gpus {gpus}; valid --tp: {valid}")
    if mode == "dp":
        return ServeLayout(dp=gpus // tp, tp=tp)
    return ServeLayout(dp=1, tp=tp, sp=gpus // tp, threshold=-1 if mode == "sp_tp" else threshold)


def check_serve_layout(setup: ServeHardware, layout: ServeLayout) -> None:
    """One line naming the valid values if the model cannot be cut this way: `shiftlm serve`'s own
    check (`ParallelConfig.check_model`) of the sp x tp ranks of one replica."""
    try:
        layout.check_model(setup.model)
    except ConfigError as err:
        raise ConfigError(f"{layout.name}: {err}") from None


def fits(
    setup: ServeHardware, layout: ServeLayout, requests: list[TraceRequest], limits: EngineLimits
) -> bool:
    try:
        scheduler_config(setup, layout, requests, limits)
    except ValueError:
        return False
    return True


def smallest_fitting_tp(
    setup: ServeHardware, mode: str, gpus: int, requests: list[TraceRequest], limits: EngineLimits
) -> int:
    """The default `--tp` for dp / sp_tp / shift: the least weight sharding whose KV room holds the
    longest request (more replicas or more SP ranks = less communication)."""
    for tp in tp_degrees(setup, gpus):
        if fits(setup, layout_for(mode, gpus, tp), requests, limits):
            return tp
    raise ValueError(
        f"{setup.model.name} does not fit on {gpus} x {setup.hardware.name} in any {mode} layout"
    )


def candidate_layouts(setup: ServeHardware, gpus: int, thresholds: tuple[int, ...]) -> list[ServeLayout]:
    """The layouts `shiftlm serve` can run: one engine of sp x tp = `gpus` ranks (full TP, SP x TP,
    or shift at each threshold); DP replicas only where the server has them (`capabilities`)."""
    layouts = []
    for tp in tp_degrees(setup, gpus):
        if tp == gpus or SERVE_DATA_PARALLEL:
            layouts.append(ServeLayout(dp=gpus // tp, tp=tp))
        if tp < gpus:
            layouts.append(ServeLayout(dp=1, tp=tp, sp=gpus // tp, threshold=-1))
            layouts += [
                ServeLayout(dp=1, tp=tp, sp=gpus // tp, threshold=threshold) for threshold in thresholds
            ]
    return layouts


@dataclass(frozen=True)
class ServePlan:
    ranked: list[ServeRun]
    dropped: list[str]  # layouts that do not fit in memory


def plan_serving(
    setup: ServeHardware,
    gpus: int,
    requests: list[TraceRequest],
    limits: EngineLimits = DEFAULT_LIMITS,
    slo: Slo = DEFAULT_SLO,
    thresholds: tuple[int, ...] = DEFAULT_THRESHOLDS,
) -> ServePlan:
    """Simulate every layout that fits; best goodput first, then lowest mean E2E."""
    runs, dropped = [], []
    for layout in candidate_layouts(setup, gpus, thresholds):
        if not fits(setup, layout, requests, limits):
            dropped.append(layout.name)
            continue
        runs.append(simulate_serving(setup, layout, requests, limits, slo))

    def key(run: ServeRun) -> tuple[float, float]:
        summary = run.summary()
        return (-summary["goodput_requests_per_s"], summary["e2e_ms"]["mean"])

    return ServePlan(sorted(runs, key=key), dropped)
