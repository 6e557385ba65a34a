"""Replay the measured tables, report per-row and per-table error, and fit the free parameters.

The fit uses only the fit split (`is_fit_row`: every other row of Megatron T1 and Korthikanti T5,
every fourth of the two vTrain tables, every other row of the Megatron-Core MoE table, every other
row of llm-foundry's A100 and H100 tables for that framework's own two parameters only, none of
torchtitan's) and reports
MAPE on the held-out rows, so a parameter set that memorises rows shows up as a gap between the two. For Korthikanti Table 5 the
even rows are the full-recompute runs, so its held-out rows are exactly the SP + selective runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from shiftlm.sim.efficiency import Efficiency
from shiftlm.sim.measured import Case
from shiftlm.sim.train import simulate_step

FIT_STRIDE = {
    "megatron_2021_table1": 2,
    "korthikanti_2022_table5": 2,
    "vtrain_multi_node": 4,
    "vtrain_single_node": 4,
    # rows 0 and 2 (Mixtral, Qwen3 TP4 EP8): with vTrain single-node's small models the only host-bound
    # runs, so two tables on two hosts determine `host_op` and each predicts the other when left out
    "megatron_core_moe_h100": 2,
    # only for llm-foundry's own parameters (fit.fit_frameworks), never the shared ones: two tables
    # (two GPU generations) determine each of them, so under leave-one-table-out either predicts the other
    "llmfoundry_a100": 2,
    "llmfoundry_h100": 2,
}


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
    tp: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1


def on_cluster(efficiency: Efficiency, case: Case, clusters: Mapping[str, float]) -> Efficiency:
    """`efficiency` with the values of every "field@scope" parameter in `clusters` whose scope is
    the case's cluster (its hardware name) or its software (`Case.software`, e.g. llm-foundry)."""
    scopes = {case.hardware.name, case.software} - {""}
    own = {
        name.split("@", 1)[0]: value for name, value in clusters.items() if name.split("@", 1)[1] in scopes
    }
    return replace(efficiency, **own) if own else efficiency


def replay(
    table: str, cases: Sequence[Case], efficiency: Efficiency, clusters: Mapping[str, float] = {}
) -> list[RowResult]:
    """Simulate every case of `table` in its own precision (Megatron-era kernels ran fp16)."""
    rows = []
    for index, case in enumerate(cases):
        step = simulate_step(
            case.model,
            case.layout,
            case.hardware,
            on_cluster(efficiency, case, clusters),
            dtype=case.dtype,
        )
        rows.append(
            RowResult(
                case.label,
                case.measured,
                case.predicted(step.step_time),
                is_fit_row(table, index),
                step.memory.total / 2**30,
                step.memory.fits,
                case.layout.tp,
                case.layout.pp,
                case.layout.dp,
            )
        )
    return rows


def mape(rows: Sequence[RowResult]) -> float:
    """Mean absolute percentage error, in percent (nan for no rows)."""
    return 100 * sum(abs(r.error) for r in rows) / len(rows) if rows else math.nan


FAMILIES = {"tp>1": lambda r: r.tp > 1, "pp>1": lambda r: r.pp > 1, "dp>1": lambda r: r.dp > 1}


def percentile_abs_error(rows: Sequence[RowResult], q: float) -> float:
    """The q-th percentile (0-100, linear interpolation) of |error| in percent; nan for no rows."""
    errors = sorted(100 * abs(r.error) for r in rows)
    if not errors:
        return math.nan
    position = (len(errors) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(errors) - 1)
    return errors[low] + (errors[high] - errors[low]) * (position - low)


def table_summary(rows: Sequence[RowResult], worst: int = 5) -> dict:
    """MAPE over all rows and over the held-out rows, p90 and max |error| of the held-out rows,
    held-out MAPE per layout family (a bad family cannot hide in the average), the worst rows."""
    held_out = [r for r in rows if not r.fit_row]
    families = {}
    for name, member in FAMILIES.items():
        family = [r for r in held_out if member(r)]
        if family:
            families[name] = {"mape_held_out_pct": mape(family), "rows": len(family)}
    return {
        "mape_pct": mape(rows),
        "mape_held_out_pct": mape(held_out),
        "p90_abs_error_held_out_pct": percentile_abs_error(held_out, 90),
        "max_abs_error_held_out_pct": percentile_abs_error(held_out, 100),
        "max_abs_error_pct": 100 * max(abs(r.error) for r in rows),
        "rows": len(rows),
        "held_out_rows": len(held_out),
        "families_held_out": families,
        "worst_held_out": [
            {"label": r.label, "measured": r.measured, "predicted": r.predicted, "error_pct": 100 * r.error}
            for r in sorted(held_out, key=lambda r: -abs(r.error))[:worst]
        ],
    }
