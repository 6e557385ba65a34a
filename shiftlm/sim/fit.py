"""Fit the simulator's free parameters on the fit split of the measured tables.

Golden-section coordinate descent on the mean over tables of the fit-split MAPE, sweep after sweep
until a sweep moves no parameter (until 2026-11-27 it stopped after 3 sweeps, short of that: the
objective was still falling: 4.62% after 3 sweeps, 4.51% at the fixed point, 10 sweeps). Each objective
evaluation re-times every fit row without simulating its pipeline: a row keeps the critical paths
(`critical_path.py`) of the points it was simulated at, and its makespan is the longest of them under
the new stage costs (exact while the critical path is among them; a lower bound otherwise). Rows are
re-simulated at the end of every sweep to collect the paths of the new point, and the returned
objective is recomputed with full simulations, so the numbers reported are never the shortcut's.

Parameters are `Efficiency` field names, or `<field>@<hardware name>` for one cluster's own value
of that field (named, fitted parameters like the others; see docs/simulator.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from shiftlm.pipeline.peak import lowered_schedule as build
from shiftlm.sim.critical_path import PathCounts, critical_path
from shiftlm.sim.efficiency import Efficiency
from shiftlm.sim.measured import Case
from shiftlm.sim.pipeline_timing import pipeline_timing
from shiftlm.sim.train import step_overheads, step_stage_costs
from shiftlm.sim.validate import is_fit_row, mape, on_cluster, replay

BOUNDS = {
    "gemm": (0.4, 1.0),
    "intra_comm": (0.3, 1.0),
    "inter_comm": (0.3, 1.0),
    "host_op": (1e-6, 60e-6),
    "kernel_overhead": (0.0, 40e-6),
    "handoff_latency": (0.0, 2e-3),
    "host_overlap": (1.0, 8.0),
    "attention_kernel": (0.2, 1.0),
    "activation_bytes": (0.0, 200.0),
}
MAX_SWEEPS = 50  # a fit with sweeps=None stops earlier, at its fixed point (the shipped fit: 10)
CLUSTER_BOUNDS = (0.3, 2.0)  # a cluster's achieved NVLink rate may exceed what its README states


@dataclass(frozen=True)
class FitResult:
    efficiency: Efficiency
    clusters: dict[str, float]  # "parameter@hardware name" -> value
    objective_pct: float  # mean fit-split MAPE over tables, from full simulations
    evaluations: int  # objective evaluations on critical paths
    simulations: int  # pipeline simulations run to collect paths


def _split(point: Mapping[str, float], start: Efficiency) -> tuple[Efficiency, dict[str, float]]:
    shared = {name: value for name, value in point.items() if "@" not in name}
    clusters = {name: value for name, value in point.items() if "@" in name}
    return replace(start, **shared), clusters


class _Row:
    """One fit row, re-timed from its collected critical paths."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self.paths: list[PathCounts] = []

    def _stage(self, efficiency: Efficiency):
        case = self.case
        return step_stage_costs(case.model, case.layout, case.hardware, efficiency, case.dtype)

    def collect(self, efficiency: Efficiency) -> None:
        """Simulate at `efficiency` and keep the critical path (pp = 1 needs none)."""
        from shiftlm.pipeline.simulator import ActionCosts, simulate

        layout = self.case.layout
        if layout.pp == 1:
            return
        stage = self._stage(efficiency)
        schedule = build(layout.schedule, layout.pp, layout.microbatches, layout.chunks)
        costs = ActionCosts(stage.forward, stage.backward_input, stage.backward_weight, p2p=stage.p2p)
        path = critical_path(schedule, simulate(schedule, costs), stage.p2p)
        if path not in self.paths:
            self.paths.append(path)

    def predicted(self, efficiency: Efficiency) -> float:
        case, stage = self.case, self._stage(efficiency)
        if case.layout.pp == 1:
            makespan = pipeline_timing(case.layout, stage).makespan
        else:
            lengths = (
                p.length(stage.forward, stage.backward_input, stage.backward_weight, stage.p2p)
                for p in self.paths
            )
            makespan = max(lengths)
        exposed_sync, optimizer = step_overheads(
            case.model, case.layout, case.hardware, efficiency, case.dtype, stage
        )
        return case.predicted(makespan + exposed_sync + optimizer)


def _golden_section(objective: Callable[[float], float], low: float, high: float, steps: int) -> float:
    ratio = (math.sqrt(5) - 1) / 2
    a, b = low, high
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = objective(c), objective(d)
    for _ in range(steps):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = objective(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = objective(d)
    return (a + b) / 2


def fit(
    cases: Mapping[str, Sequence[Case]],
    start: Efficiency,
    parameters: Sequence[str] = tuple(BOUNDS),
    sweeps: int | None = None,
    steps: int = 16,
) -> FitResult:
    """Coordinate descent over `parameters` on the fit rows of `cases`; everything else stays at
    `start`. Golden section narrows each bound by 0.618^steps (16 steps: < 0.1% of the range).
    `sweeps` over all parameters; None: until a sweep leaves every parameter where it was (values
    kept to 3 significant digits, so the descent reaches a fixed point; at most `MAX_SWEEPS`)."""
    rows = {
        table: [_Row(case) for index, case in enumerate(table_cases) if is_fit_row(table, index)]
        for table, table_cases in cases.items()
    }
    rows = {table: table_rows for table, table_rows in rows.items() if table_rows}
    point = {name: _start_value(name, start) for name in parameters}
    evaluations = simulations = 0

    def objective(candidate: Mapping[str, float]) -> float:
        nonlocal evaluations
        evaluations += 1
        shared, clusters = _split(candidate, start)
        errors = []
        for table_rows in rows.values():
            errors.append(
                100
                * sum(
                    abs(row.predicted(on_cluster(shared, row.case, clusters)) / row.case.measured - 1)
                    for row in table_rows
                )
                / len(table_rows)
            )
        return sum(errors) / len(errors)

    def collect_paths() -> None:
        nonlocal simulations
        shared, clusters = _split(point, start)
        for table_rows in rows.values():
            for row in table_rows:
                row.collect(on_cluster(shared, row.case, clusters))
                simulations += row.case.layout.pp > 1

    collect_paths()
    for _ in range(MAX_SWEEPS if sweeps is None else sweeps):
        before = dict(point)
        for name in parameters:
            low, high = parameter_bounds(name)
            best = _golden_section(lambda value, n=name: objective({**point, n: value}), low, high, steps)
            point[name] = float(f"{best:.3g}")
        collect_paths()
        if sweeps is None and point == before:
            break
    efficiency, clusters = _split(point, start)
    exact = [
        mape(replay(table, [row.case for row in table_rows], efficiency, clusters))
        for table, table_rows in rows.items()
    ]
    return FitResult(efficiency, clusters, sum(exact) / len(exact), evaluations, simulations)


def parameter_bounds(name: str) -> tuple[float, float]:
    """A shared parameter's bounds; a cluster's NVLink factor may exceed its README's rate."""
    base = name.split("@", 1)[0]
    if "@" in name and base == "intra_comm":
        return CLUSTER_BOUNDS
    return BOUNDS[base]


def _start_value(name: str, start: Efficiency) -> float:
    return getattr(start, name.split("@", 1)[0])


@dataclass(frozen=True)
class TablesFit:
    """`--refit`'s two stages on a set of tables: the shared constants on the tables of no
    particular framework, then each framework's own parameters on its tables, shared ones fixed."""

    efficiency: Efficiency
    scoped: dict[str, float]  # "parameter@scope" -> value, only for scopes some fit row runs on
    objective_pct: float
    software_objective_pct: float | None
    evaluations: int
    simulations: int


def _determines(name: str, case: Case) -> bool:
    """Whether a run can determine the scoped constant `name`: a cluster's InfiniBand share only
    moves runs that span nodes (a single-node table on the same cluster says nothing about it)."""
    if name.split("@", 1)[0] == "inter_comm":
        return case.layout.gpus > case.hardware.gpus_per_node
    return True


def fittable(parameters: Sequence[str], cases: Mapping[str, Sequence[Case]]) -> tuple[str, ...]:
    """`parameters` less every "field@scope" that no fit row of `cases` on that scope (its cluster
    or framework) determines: a table left out takes the constants only it determines with it (they
    stay at the shared value)."""
    fit_rows = [
        case for table, rows in cases.items() for index, case in enumerate(rows) if is_fit_row(table, index)
    ]

    def kept(name: str) -> bool:
        if "@" not in name:
            return True
        scope = name.split("@", 1)[1]
        return any(
            scope in (case.hardware.name, case.software) and _determines(name, case) for case in fit_rows
        )

    return tuple(name for name in parameters if kept(name))


def fit_shared(
    cases: Mapping[str, Sequence[Case]], parameters: Sequence[str], start: Efficiency
) -> FitResult | None:
    """Stage 1: the shared constants on the tables whose runs name no framework (None if none of
    them has a fit row)."""
    shared = {table: rows for table, rows in cases.items() if not any(case.software for case in rows)}
    if not any(is_fit_row(table, index) for table, rows in shared.items() for index in range(len(rows))):
        return None
    return fit(shared, start, fittable(parameters, shared))


def fit_frameworks(
    cases: Mapping[str, Sequence[Case]], shared: Efficiency, parameters: Sequence[str]
) -> FitResult | None:
    """Stage 2: each framework's own parameters on its tables, the shared constants fixed."""
    framework = {table: rows for table, rows in cases.items() if any(case.software for case in rows)}
    names = fittable(parameters, framework)
    return fit(framework, shared, names) if names else None


def combine(first: FitResult | None, second: FitResult | None, start: Efficiency) -> TablesFit:
    """The two stages' results as one (a stage that had no fit rows is None)."""
    runs = [r for r in (first, second) if r]
    return TablesFit(
        first.efficiency if first else start,
        (first.clusters if first else {}) | (second.clusters if second else {}),
        first.objective_pct if first else math.nan,
        second.objective_pct if second else None,
        sum(r.evaluations for r in runs),
        sum(r.simulations for r in runs),
    )


def fit_tables(
    cases: Mapping[str, Sequence[Case]],
    parameters: Sequence[str],
    software: Sequence[str],
    start: Efficiency,
) -> TablesFit:
    """`--refit`: the shared constants, then each framework's own with the shared ones fixed."""
    first = fit_shared(cases, parameters, start)
    return combine(first, fit_frameworks(cases, first.efficiency if first else start, software), start)
