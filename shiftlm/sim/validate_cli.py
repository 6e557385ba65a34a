"""`shiftlm simulate validate`: per-row predicted vs measured, MAPE per table, fitted and unfitted."""

from __future__ import annotations

import argparse

from shiftlm.sim import jsonout
from shiftlm.sim.efficiency import FIRST_PRINCIPLES, FIT_PARAMETERS, FITTED, FITTED_CLUSTER_INTRA_COMM
from shiftlm.sim.measured import default_data_dir, load_cases
from shiftlm.sim.validate import replay, table_summary

TARGET_PCT = {"megatron_2021_table1": 10.0, "korthikanti_2022_table5": 5.0, "vtrain_multi_node": 10.0}


def run_validate(args: argparse.Namespace) -> int:
    data_dir = args.data if args.data else default_data_dir()
    if data_dir.name != "measured" and (data_dir / "measured").is_dir():
        data_dir = data_dir / "measured"
    tables = None
    if args.no_single_node:
        tables = ["megatron_2021_table1", "korthikanti_2022_table5", "vtrain_multi_node"]
    cases = load_cases(data_dir, tables)
    fitted, clusters = FITTED, FITTED_CLUSTER_INTRA_COMM
    report: dict = {"tables": {}}
    if args.refit:
        from shiftlm.sim.fit import fit

        fit_tables = {t: rows for t, rows in cases.items() if t != "vtrain_single_node"}
        result = fit(fit_tables, FIRST_PRINCIPLES, FIT_PARAMETERS)
        fitted, clusters = result.efficiency, result.cluster_intra_comm
        report["fit"] = {
            "objective_fit_split_mape_pct": result.objective_pct,
            "evaluations": result.evaluations,
            "simulations": result.simulations,
        }
    report["parameters"] = {
        "first_principles": FIRST_PRINCIPLES.as_dict(),
        "fitted": fitted.as_dict() | {f"intra_comm@{name}": value for name, value in clusters.items()},
    }
    for table, rows in cases.items():
        entry = {}
        for name, efficiency, cluster in (
            ("first_principles", FIRST_PRINCIPLES, {}),
            ("fitted", fitted, clusters),
        ):
            results = replay(table, rows, efficiency, cluster)
            entry[name] = table_summary(results)
            entry[name]["rows_detail"] = [
                {
                    "label": r.label,
                    "measured": r.measured,
                    "predicted": r.predicted,
                    "error_pct": 100 * r.error,
                    "fit_row": r.fit_row,
                    "memory_gib": round(r.memory_gib, 1),
                    "fits_memory": r.fits_memory,
                }
                for r in results
            ]
        entry["metric"] = rows[0].metric
        entry["target_mape_pct"] = TARGET_PCT.get(table)
        report["tables"][table] = entry
    if args.json:
        print(jsonout.dumps(report))
    else:
        _print(report)
    return 0


def _print(report: dict) -> None:
    params = report["parameters"]
    print(
        "parameters (first principles -> fitted): "
        + ", ".join(
            f"{k} {params['first_principles'].get(k.split('@')[0], 1.0):g} -> {v:g}"
            for k, v in params["fitted"].items()
        )
    )
    if "fit" in report:
        print(f"fit: {report['fit']}")
    for table, entry in report["tables"].items():
        print(f"\n== {table} ({entry['metric']}; * = fit row)")
        unfitted, fitted = entry["first_principles"], entry["fitted"]
        for before, after in zip(unfitted["rows_detail"], fitted["rows_detail"]):
            mark = "*" if after["fit_row"] else " "
            oom = "" if after["fits_memory"] else " OOM"
            print(
                f" {mark} {after['label']:42s} measured {after['measured']:9.3f}  "
                f"first-principles {before['predicted']:9.3f} ({before['error_pct']:+6.1f}%)  "
                f"fitted {after['predicted']:9.3f} ({after['error_pct']:+6.1f}%)  {after['memory_gib']:5.1f} GiB{oom}"
            )
        target = entry["target_mape_pct"]
        verdict = "" if target is None else f"  target <= {target:g}%"
        print(
            f"   MAPE first-principles {unfitted['mape_pct']:.2f}% | fitted {fitted['mape_pct']:.2f}% "
            f"(held-out {fitted['mape_held_out_pct']:.2f}%, max |err| {fitted['max_abs_error_pct']:.1f}%){verdict}"
        )
