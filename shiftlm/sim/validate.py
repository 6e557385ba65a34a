"""Replay the measured tables, report per-row and per-table error, and fit the free parameters.

The fit uses only the fit split (`is_fit_row`: every other row of each multi-node table, every
fourth of vTrain multi-node, none of vTrain single-node) and reports MAPE on the held-out rows, so
a parameter set that memorises rows shows up as a gap between the two. For Korthikanti Table 5 the
even rows are the full-recompute runs, so its held-out rows are exactly the SP + selective runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from shiftlm.sim.efficiency import Efficiency
from shiftlm.sim.measured import Case
from shiftlm.sim.train import simulate_step

FIT_STRIDE = {"megatron_2021_table1": 2, "korthikanti_2022_table5": 2, "vtrain_multi_node": 4}


def is_fit_row(table: str, index: int) -> bool:
    stride = FIT_STRIDE.get(table)
    return stride is not None and index % stride == 0


@dataclass(frozen=True)
class RowResult:
    label: str
    measured: float
    predicted: float
    fit_row: bool
    memory_gib: float
    fits_memory: bool

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1


def on_cluster(
    efficiency: Efficiency, hardware_name: str, cluster_intra_comm: Mapping[str, float]
) -> Efficiency:
    """`efficiency` with the intra-node link factor of `hardware_name`'s cluster, where one is fitted."""
    if hardware_name in cluster_intra_comm:
        return replace(efficiency, intra_comm=cluster_intra_comm[hardware_name])
    return efficiency


def replay(
    table: str, cases: Sequence[Case], efficiency: Efficiency, cluster_intra_comm: Mapping[str, float] = {}
) -> list[RowResult]:
    """Simulate every case of `table` (Megatron-era kernels ran fp16)."""
    rows = []
    for index, case in enumerate(cases):
        step = simulate_step(
            case.model,
            case.layout,
            case.hardware,
            on_cluster(efficiency, case.hardware.name, cluster_intra_comm),
            dtype="fp16",
        )
        rows.append(
            RowResult(
                case.label,
                case.measured,
                case.predicted(step.step_time),
                is_fit_row(table, index),
                step.memory.total / 2**30,
                step.memory.fits,
            )
        )
    return rows


def mape(rows: Sequence[RowResult]) -> float:
    """Mean absolute percentage error, in percent (nan for no rows)."""
    return 100 * sum(abs(r.error) for r in rows) / len(rows) if rows else math.nan


def table_summary(rows: Sequence[RowResult]) -> dict[str, float]:
    held_out = [r for r in rows if not r.fit_row]
    return {
        "mape_pct": mape(rows),
        "mape_held_out_pct": mape(held_out),
        "max_abs_error_pct": 100 * max(abs(r.error) for r in rows),
        "rows": len(rows),
        "held_out_rows": len(held_out),
    }
