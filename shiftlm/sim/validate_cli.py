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
from shiftlm.sim.validate import RowResult, mape, replay, table_summary

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
    held_out = None
    if args.leave_one_table_out:
        from shiftlm.sim.loto import leave_one_table_out

        # the full refit comes with it: the per-row hold-out beside it is that refit's
        refit, held_out = leave_one_table_out(
            cases, FIT_PARAMETERS, SOFTWARE_PARAMETERS, FIRST_PRINCIPLES, args.jobs
        )
    elif args.refit:
        from shiftlm.sim.fit import fit_tables

        refit = fit_tables(cases, FIT_PARAMETERS, SOFTWARE_PARAMETERS, FIRST_PRINCIPLES)
    if args.leave_one_table_out or args.refit:
        fitted, clusters = refit.efficiency, refit.scoped
        report["fit"] = {
            "objective_fit_split_mape_pct": refit.objective_pct,
            "software_objective_fit_split_mape_pct": refit.software_objective_pct,
            "evaluations": refit.evaluations,
            "simulations": refit.simulations,
        }
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
    loto_rows = {}
    if held_out is not None:
        report["leave_one_table_out"] = _loto_report(report, held_out, cases, fitted, clusters, args.jobs)
        loto_rows = {t: replay(t, cases[t], h.fit.efficiency, h.fit.scoped) for t, h in held_out.items()}
    if args.plot is not None:
        titles = {}
        for table, entry in report["tables"].items():
            titles[table] = f"held-out rows {entry['fitted']['mape_held_out_pct']:.1f}%"
            if table in loto_rows:
                titles[table] = f"leave-one-table-out {mape(loto_rows[table]):.1f}%, " + titles[table]
        write_scatter(args.plot, scatter, {t: rows[0].metric for t, rows in cases.items()}, titles, loto_rows)
        report["plot"] = str(args.plot)
    if args.json:
        print(jsonout.dumps(report))
    else:
        _print(report, args.rows)
    return 0


def _loto_report(report: dict, held_out: dict, cases: dict, fitted, clusters: dict, jobs) -> dict:
    """Each table's error when the fit never saw it, beside its per-row hold-out; the constants the
    full refit fitted, each with the tables whose fit rows determine it (`loto.determination`)."""
    from shiftlm.sim.loto import DETERMINES_PCT, PROBE, determination

    names = [*FIT_PARAMETERS, *(name for name in clusters if name not in FIT_PARAMETERS)]

    def constants(efficiency, scoped) -> dict:
        # a "field@scope" constant absent from `scoped` was not fitted (its only table was left out)
        return {name: getattr(efficiency, name) for name in FIT_PARAMETERS if "@" not in name} | scoped

    tables = {
        table: {
            "mape_pct": h.mape_pct,
            "per_row_held_out_mape_pct": report["tables"][table]["fitted"]["mape_held_out_pct"],
            "fitted_without_it": constants(h.fit.efficiency, h.fit.scoped),
            # constants only this table determines: not refitted without it (first-principles values)
            "left_at_first_principles": list(h.unfitted),
        }
        for table, h in held_out.items()
    }
    moved = determination(cases, fitted, clusters, names, jobs)
    errors = [h.mape_pct for h in held_out.values()]
    return {
        "mean_mape_pct": sum(errors) / len(errors),
        "max_mape_pct": max(errors),
        "tables": tables,
        "fitted_constant_count": len(names),
        "fitted_constants": {
            name: {
                "value": value,
                "determined_by": sorted(t for t, points in moved[name].items() if points >= DETERMINES_PCT),
                "fit_split_mape_moved_pct": moved[name],
            }
            for name, value in constants(fitted, clusters).items()
        },
        "determination": f"a table determines a constant when moving it +-{PROBE:.0%} moves the table's "
        f"fit-split MAPE by >= {DETERMINES_PCT} points",
    }


def scatter_figure(
    tables: dict[str, list[RowResult]],
    metrics: dict[str, str],
    titles: dict[str, str] | None = None,
    loto: dict[str, list[RowResult]] | None = None,
):
    """Predicted vs measured, log-log, a grid of panels, one per dataset (`metrics`: table -> its
    metric, for the axis label; `titles`: table -> the errors under its name). Fit rows hollow,
    held-out rows filled; `loto`: the same rows predicted by the refit that never saw the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    columns = min(3, len(tables))
    lines = -(-len(tables) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(5.0 * columns, 4.8 * lines), squeeze=False)
    for ax in axes.flat[len(tables) :]:
        ax.set_visible(False)
    loto = loto or {}
    for ax, (table, rows) in zip(axes.flat, tables.items()):
        series = [
            ([r for r in rows if r.fit_row], "fit row", dict(facecolors="none", edgecolors="C0", s=14)),
            ([r for r in rows if not r.fit_row], "held-out row", dict(c="C1", s=10)),
            (loto.get(table, []), "fit without this table", dict(c="C3", marker="x", s=14, linewidths=0.8)),
        ]
        for chosen, label, style in series:
            if chosen:
                ax.scatter([r.measured for r in chosen], [r.predicted for r in chosen], label=label, **style)
        values = [v for chosen, _, _ in series for r in chosen for v in (r.measured, r.predicted)]
        low, high = min(values) / 1.15, max(values) * 1.15
        ax.plot([low, high], [low, high], "k-", lw=0.8)
        for factor in (0.9, 1.1):
            ax.plot([low, high], [low * factor, high * factor], "k:", lw=0.6)
        ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high))
        # labels at 1-2-5 steps only; matplotlib's default also labels minor ticks on a log axis
        # spanning less than a decade, and those run into each other
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(NullFormatter())
        ax.tick_params(labelsize=9)
        ax.set_title(f"{table} ({len(rows)} rows)\n{(titles or {}).get(table, '')}", fontsize=10)
        unit = UNITS.get(metrics.get(table, ""), "")
        ax.set_xlabel(f"measured ({unit})", fontsize=9)
        ax.set_ylabel(f"predicted ({unit})", fontsize=9)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("shiftlm simulate validate: predicted vs measured (solid: equal, dotted: +-10%)")
    fig.tight_layout()
    return fig


def write_scatter(path: Path, *args, **kwargs) -> None:
    """`scatter_figure(...)` as a PNG."""
    fig = scatter_figure(*args, **kwargs)
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
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
    if "leave_one_table_out" in report:
        loto = report["leave_one_table_out"]
        print(
            "\nleave-one-table-out: refit without the table, MAPE over all its rows (per-row hold-out beside)"
        )
        for table, entry in loto["tables"].items():
            prior = ", ".join(entry["left_at_first_principles"])
            print(
                f"   {table:28s} {entry['mape_pct']:6.2f}%   per-row held-out {entry['per_row_held_out_mape_pct']:6.2f}%"
                + (f"   (not refitted without it: {prior})" if prior else "")
            )
        print(f"   mean {loto['mean_mape_pct']:.2f}%, max {loto['max_mape_pct']:.2f}%")
        print(
            f"fitted constants ({loto['fitted_constant_count']}) and the tables that determine each ({loto['determination']}):"
        )
        for name, constant in loto["fitted_constants"].items():
            print(f"   {name:30s} {constant['value']:<10.4g} {', '.join(constant['determined_by']) or '-'}")
    if "plot" in report:
        print(f"\nwrote {report['plot']}")
