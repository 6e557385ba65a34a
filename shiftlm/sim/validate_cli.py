"""`shiftlm simulate validate`: one table per dataset (MAPE, held-out MAPE, p90 |error|, the worst
rows, held-out MAPE per layout family), first-principles vs fitted vs fitted without the cluster
parameters, and a log-log scatter plot of predicted vs measured for every dataset."""

from __future__ import annotations

import argparse
from pathlib import Path

from shiftlm.sim import jsonout
from shiftlm.sim.efficiency import (
    FIRST_PRINCIPLES,
    FIT_PARAMETERS,
    FITTED,
    FITTED_CLUSTER,
    SOFTWARE_PARAMETERS,
)
from shiftlm.sim.measured import TABLES, default_data_dir, load_cases
from shiftlm.sim.validate import RowResult, replay, table_summary

# Held-out MAPE goals (issue 17); the vTrain single-node table also has p90 |error| <= 15%.
TARGET_PCT = {
    "megatron_2021_table1": 4.0,
    "korthikanti_2022_table5": 3.0,
    "vtrain_multi_node": 7.0,
    "vtrain_single_node": 8.0,
    # "an H100 MFU table measured by others predicted within the goal": the single-node table's 8%
    "llmfoundry_h100": 8.0,
}
TARGET_P90_PCT = {"vtrain_single_node": 15.0}
UNITS = {
    "tflops_per_gpu": "TFLOP/s per GPU",
    "iteration_s": "iteration s",
    "tokens_per_s_per_gpu": "tokens/s per GPU",
}


def run_validate(args: argparse.Namespace) -> int:
    data_dir = args.data if args.data else default_data_dir()
    if data_dir.name != "measured" and (data_dir / "measured").is_dir():
        data_dir = data_dir / "measured"
    tables = None
    if args.no_single_node:
        tables = [table for table in TABLES if table != "vtrain_single_node"]
    cases = load_cases(data_dir, tables)
    fitted, clusters = FITTED, FITTED_CLUSTER
    report: dict = {"tables": {}}
    if args.refit:
        from shiftlm.sim.fit import fit

        # the shared constants on the tables of no particular framework, then each framework's own
        # parameters on its tables with the shared ones fixed
        framework = {table: rows for table, rows in cases.items() if any(case.software for case in rows)}
        shared = {table: rows for table, rows in cases.items() if table not in framework}
        result = fit(shared, FIRST_PRINCIPLES, FIT_PARAMETERS)
        software = fit(framework, result.efficiency, SOFTWARE_PARAMETERS) if framework else None
        fitted = result.efficiency
        clusters = result.clusters | (software.clusters if software else {})
        report["fit"] = {
            "objective_fit_split_mape_pct": result.objective_pct,
            "evaluations": result.evaluations,
            "simulations": result.simulations,
        }
        if software:
            report["fit"]["software_objective_fit_split_mape_pct"] = software.objective_pct
    report["parameters"] = {
        "first_principles": FIRST_PRINCIPLES.as_dict(),
        "fitted": fitted.as_dict() | dict(clusters),
    }
    scatter: dict[str, list[RowResult]] = {}
    for table, rows in cases.items():
        entry: dict = {"metric": rows[0].metric}
        variants = [("first_principles", FIRST_PRINCIPLES, {}), ("fitted", fitted, clusters)]
        scopes = {case.hardware.name for case in rows} | {case.software for case in rows}
        if any(name.split("@", 1)[1] in scopes for name in clusters):
            variants.append(("fitted_without_cluster_parameters", fitted, {}))
        for name, efficiency, cluster in variants:
            results = replay(table, rows, efficiency, cluster)
            entry[name] = table_summary(results)
            if name == "fitted":
                scatter[table] = results
                entry["rows_detail"] = [
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
        entry["target_mape_held_out_pct"] = TARGET_PCT.get(table)
        entry["target_p90_abs_error_held_out_pct"] = TARGET_P90_PCT.get(table)
        report["tables"][table] = entry
    if args.plot is not None:
        write_scatter(scatter, args.plot, {table: rows[0].metric for table, rows in cases.items()})
        report["plot"] = str(args.plot)
    if args.json:
        print(jsonout.dumps(report))
    else:
        _print(report, args.rows)
    return 0


def write_scatter(tables: dict[str, list[RowResult]], path: Path, metrics: dict[str, str]) -> None:
    """Predicted vs measured, log-log, one panel per dataset (`metrics`: table -> its metric, for the
    axis label); fit rows hollow, held-out rows filled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tables), figsize=(4.2 * len(tables), 4.2), squeeze=False)
    for ax, (table, rows) in zip(axes[0], tables.items()):
        for fit_rows, style in ((True, dict(facecolors="none", edgecolors="C0")), (False, dict(c="C1"))):
            chosen = [r for r in rows if r.fit_row == fit_rows]
            if chosen:
                ax.scatter(
                    [r.measured for r in chosen],
                    [r.predicted for r in chosen],
                    s=10,
                    label="fit split" if fit_rows else "held out",
                    **style,
                )
        values = [v for r in rows for v in (r.measured, r.predicted)]
        low, high = min(values) / 1.2, max(values) * 1.2
        ax.plot([low, high], [low, high], "k-", lw=0.8)
        for factor in (0.9, 1.1):
            ax.plot([low, high], [low * factor, high * factor], "k:", lw=0.6)
        ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high), title=table)
        unit = UNITS.get(metrics.get(table, ""), "")
        ax.set_xlabel(f"measured ({unit})")
        ax.set_ylabel("predicted")
        ax.legend(fontsize=7)
    fig.suptitle("shiftlm simulate validate: predicted vs measured (dotted: +-10%)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}%"


def _print(report: dict, show_rows: bool) -> None:
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
        print(
            f"\n== {table} ({entry['metric']}, {entry['fitted']['rows']} rows, "
            f"{entry['fitted']['held_out_rows']} held out)"
        )
        print(f"   {'variant':36s} {'MAPE':>8s} {'held-out':>9s} {'p90|err|':>9s} {'max|err|':>9s}")
        for name in ("first_principles", "fitted", "fitted_without_cluster_parameters"):
            if name in entry:
                s = entry[name]
                print(
                    f"   {name:36s} {_fmt(s['mape_pct']):>8s} {_fmt(s['mape_held_out_pct']):>9s} "
                    f"{_fmt(s['p90_abs_error_held_out_pct']):>9s} {_fmt(s['max_abs_error_held_out_pct']):>9s}"
                )
        fitted = entry["fitted"]
        families = ", ".join(
            f"{k} {v['mape_held_out_pct']:.2f}% ({v['rows']})" for k, v in fitted["families_held_out"].items()
        )
        if families:
            print(f"   held-out MAPE by family (fitted): {families}")
        target, p90 = entry["target_mape_held_out_pct"], entry["target_p90_abs_error_held_out_pct"]
        if target is not None:
            met = fitted["mape_held_out_pct"] <= target and (
                p90 is None or fitted["p90_abs_error_held_out_pct"] <= p90
            )
            goal = f"held-out MAPE <= {target:g}%" + (f", p90 <= {p90:g}%" if p90 else "")
            print(f"   goal {goal}: {'met' if met else 'NOT met'}")
        print("   worst held-out rows (fitted):")
        for row in fitted["worst_held_out"]:
            print(
                f"     {row['label']:44s} measured {row['measured']:9.3f} predicted {row['predicted']:9.3f} "
                f"({row['error_pct']:+6.1f}%)"
            )
        if show_rows:
            for row in entry["rows_detail"]:
                mark = "*" if row["fit_row"] else " "
                oom = "" if row["fits_memory"] else " OOM"
                print(
                    f"   {mark} {row['label']:44s} measured {row['measured']:9.3f} predicted "
                    f"{row['predicted']:9.3f} ({row['error_pct']:+6.1f}%) {row['memory_gib']:5.1f} GiB{oom}"
                )
    if "plot" in report:
        print(f"\nwrote {report['plot']}")
