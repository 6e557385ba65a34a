"""Leave-one-table-out validation and which tables determine each fitted constant.

For each measured table: refit (`fit.fit_tables`, `--refit`'s two stages) on the fit rows of every
*other* table, starting from the first-principles defaults, and replay every row of the table left
out. A table's own cluster or framework constants leave with it (`fit.fittable`): with no fit row
left on that cluster or framework they stay at the shared value. So does any shared constant that
only the table left out determines (`determination` on the full fit, issue 33: "refit with that
table removed entirely (every row, and any constant only it determines)"): no other table says
anything about it, so the refit leaves it at its first-principles value instead of wherever the
other tables' noise puts it. The refits start from `FIRST_PRINCIPLES`, not from the full fit, which
has seen the table left out.

Refits that see the same tables are one refit: a table without fit rows (never fitted) leaves the
full fit as it is, and a framework's table leaves the shared stage as it is (it never sees one).
The distinct refits run in parallel processes (`jobs`), the longest first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

from shiftlm.sim.efficiency import Efficiency
from shiftlm.sim.fit import (
    BOUNDS,
    FitResult,
    TablesFit,
    combine,
    fit_frameworks,
    fit_shared,
    parameter_bounds,
)
from shiftlm.sim.measured import Case
from shiftlm.sim.validate import is_fit_row, mape, replay

PROBE = 0.2  # determination: move a constant by +-20% of its value ...
DETERMINES_PCT = 0.25  # ... and a table determines it if its fit-split MAPE moves by this many points


@dataclass(frozen=True)
class HeldOut:
    table: str
    fit: TablesFit  # the refit without the table
    mape_pct: float  # over every row of the table left out
    unfitted: tuple[str, ...] = ()  # constants only this table determines: at first principles without it


def _has_fit_rows(table: str, rows: Sequence[Case]) -> bool:
    return any(is_fit_row(table, index) for index in range(len(rows)))


def _shared_tables(cases: Mapping[str, Sequence[Case]]) -> frozenset[str]:
    return frozenset(
        table
        for table, rows in cases.items()
        if not any(c.software for c in rows) and _has_fit_rows(table, rows)
    )


def _without(cases: Mapping[str, Sequence[Case]], tables) -> dict[str, Sequence[Case]]:
    return {table: rows for table, rows in cases.items() if table not in tables}


def _shared_job(job: tuple) -> FitResult | None:
    cases, parameters, start = job
    return fit_shared(cases, parameters, start)


def _framework_job(job: tuple) -> FitResult | None:
    cases, shared, software = job
    return fit_frameworks(cases, shared, software)


def determined_by(moved: Mapping[str, Mapping[str, float]]) -> dict[str, frozenset[str]]:
    """`determination`'s points as the set of tables that determine each constant."""
    return {
        name: frozenset(t for t, p in points.items() if p >= DETERMINES_PCT) for name, points in moved.items()
    }


def leave_one_table_out(
    cases: Mapping[str, Sequence[Case]],
    parameters: Sequence[str],
    software: Sequence[str],
    start: Efficiency,
    jobs: int | None = None,
) -> tuple[TablesFit, dict[str, HeldOut]]:
    """The full refit and, for every table, the refit without it and its error on all its rows.
    A constant that only the table left out determines (on the full refit) is not refitted: it
    stays at `start`'s value."""
    shared_all = _shared_tables(cases)
    workers = max(1, min(jobs or os.cpu_count() or 1, len(cases)))
    with ProcessPoolExecutor(workers) as pool:
        first_all = fit_shared(cases, parameters, start)
        full = combine(
            first_all, fit_frameworks(cases, first_all.efficiency if first_all else start, software), start
        )
        names = [*parameters, *(n for n in full.scoped if n not in parameters)]
        by = determined_by(determination(cases, full.efficiency, full.scoped, names, jobs, pool))
        unfitted = {table: tuple(n for n in names if by.get(n) == {table}) for table in cases}
        # stage 1 per distinct (shared tables it sees, constants it fits)
        keys = {
            table: (shared_all - {table}, tuple(p for p in parameters if p not in unfitted[table]))
            for table in cases
        }
        full_key = (shared_all, tuple(parameters))
        distinct = sorted(set(keys.values()) - {full_key}, key=lambda k: -sum(len(cases[t]) for t in k[0]))
        stage1 = dict(
            zip(
                distinct,
                pool.map(
                    _shared_job, [({t: cases[t] for t in key}, params, start) for key, params in distinct]
                ),
            )
        )
        stage1[full_key] = first_all
        stage2_jobs = []
        for table in cases:
            first = stage1[keys[table]]
            shared = first.efficiency if first else start
            own = tuple(p for p in software if p not in unfitted[table])
            stage2_jobs.append((_without(cases, {table}), shared, own))
        stage2 = list(pool.map(_framework_job, stage2_jobs))

    results = {}
    for table, second in zip(cases, stage2):
        refit = combine(stage1[keys[table]], second, start)
        rows = replay(table, cases[table], refit.efficiency, refit.scoped)
        results[table] = HeldOut(table, refit, mape(rows), unfitted[table])
    return full, results


def _fit_split_mape(table: str, rows: Sequence[Case], efficiency: Efficiency, scoped: dict) -> float:
    chosen = [case for index, case in enumerate(rows) if is_fit_row(table, index)]
    return mape(replay(table, chosen, efficiency, scoped))


def _probe_job(job: tuple) -> tuple[str, str, float]:
    name, table, rows, efficiency, scoped = job
    base = _fit_split_mape(table, rows, efficiency, scoped)
    value = scoped[name] if "@" in name else getattr(efficiency, name)
    low, high = parameter_bounds(name)
    moved = 0.0
    for factor in (1 - PROBE, 1 + PROBE):
        probe = min(max(value * factor, low), high)
        if "@" in name:
            error = _fit_split_mape(table, rows, efficiency, scoped | {name: probe})
        else:
            error = _fit_split_mape(table, rows, replace(efficiency, **{name: probe}), scoped)
        moved = max(moved, abs(error - base))
    return name, table, moved


def determination(
    cases: Mapping[str, Sequence[Case]],
    efficiency: Efficiency,
    scoped: dict[str, float],
    parameters: Sequence[str],
    jobs: int | None = None,
    pool: ProcessPoolExecutor | None = None,
) -> dict[str, dict[str, float]]:
    """For each fitted constant, how far each fit table's fit-split MAPE moves (points, the larger
    of the two directions) when the constant moves +-20% from its fitted value, the others fixed.
    A table determines the constant where that is >= `DETERMINES_PCT`. Only the tables of the
    constant's stage count: shared constants on the tables of no framework, a framework's on its own."""
    assert all(name.split("@", 1)[0] in BOUNDS for name in parameters)
    work = []
    for name in parameters:
        scope = name.split("@", 1)[1] if "@" in name else None
        for table, rows in cases.items():
            if not _has_fit_rows(table, rows):
                continue
            framework = any(case.software for case in rows)
            if scope is None and framework:
                continue
            if scope is not None and not any(scope in (c.hardware.name, c.software) for c in rows):
                continue
            work.append((name, table, rows, efficiency, scoped))
    if pool is not None:
        moved = list(pool.map(_probe_job, work))
    else:
        with ProcessPoolExecutor(max(1, min(jobs or os.cpu_count() or 1, len(work)))) as own:
            moved = list(own.map(_probe_job, work))
    result: dict[str, dict[str, float]] = {name: {} for name in parameters}
    for name, table, points in moved:
        result[name][table] = points
    return result
