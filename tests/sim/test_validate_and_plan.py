"""Validation error on the measured tables, the fitter, and the planner's exactness."""

from __future__ import annotations

from dataclasses import replace

import pytest
import tomllib

from shiftlm.sim.efficiency import FIRST_PRINCIPLES, FITTED
from shiftlm.sim.hardware import CATALOG
from shiftlm.sim.measured import default_data_dir, load_cases
from shiftlm.sim.models import PRESETS
from shiftlm.sim.planner import enumerate_layouts, plan_training, train_config_toml
from shiftlm.sim.train import simulate_step
from shiftlm.sim.validate import fit, mape, replay

needs_data = pytest.mark.skipif(not default_data_dir().is_dir(), reason="../shared/data/measured not present")


@needs_data
@pytest.mark.parametrize(
    "table, target",
    [
        ("korthikanti_2022_table5", 5.0),
        pytest.param(
            "vtrain_multi_node",
            10.0,
            marks=pytest.mark.xfail(
                reason="12.5% MAPE: TP-heavy rows too slow at the README's 150 GB/s NVLink"
            ),
        ),
    ],
)
def test_fitted_model_meets_the_mape_target(table, target):
    rows = replay(table, load_cases(default_data_dir(), [table])[table], FITTED)
    assert mape(rows) <= target


@needs_data
def test_every_megatron_table1_row_is_within_10_percent():
    table = "megatron_2021_table1"
    for row in replay(table, load_cases(default_data_dir(), [table])[table], FITTED):
        assert abs(row.error) <= 0.10, row


@needs_data
def test_fit_recovers_a_known_gemm_efficiency_from_synthetic_measurements():
    small = [
        c
        for c in load_cases(default_data_dir(), ["vtrain_multi_node"])["vtrain_multi_node"]
        if c.layout.pp <= 2
    ]
    truth = replace(FIRST_PRINCIPLES, gemm=0.6)
    synthetic = [
        replace(case, measured=row.predicted)
        for case, row in zip(small, replay("vtrain_multi_node", small, truth))
    ]
    fitted = fit({"vtrain_multi_node": synthetic}, FIRST_PRINCIPLES, parameters=("gemm",), sweeps=1, steps=14)
    assert fitted.gemm == pytest.approx(0.6, abs=0.01)


def test_planner_top_layout_is_the_fastest_that_fits_among_all_candidates():
    model, h100 = PRESETS["qwen2.5-7b"], CATALOG["h100-sxm"]
    plan = plan_training(model, h100, gpus=8, seq_len=4096, global_batch=16, top_k=1)
    exhaustive = [
        simulate_step(model, layout, h100, FIRST_PRINCIPLES)
        for layout in enumerate_layouts(model, 8, h100.gpus_per_node, 4096, 16)
    ]
    best = min(r.step_time for r in exhaustive if r.memory.fits)
    assert plan.ranked[0].result.step_time == pytest.approx(best)
    assert plan.simulated < len(exhaustive)


def test_plan_writes_a_train_config_with_the_agreed_schema():
    plan = plan_training(
        PRESETS["llama3-8b"], CATALOG["h100-sxm"], gpus=8, seq_len=4096, global_batch=16, top_k=1
    )
    config = tomllib.loads(train_config_toml("llama3-8b", plan.ranked[0].layout))
    assert config["model"]["name"] == "llama3-8b"
    layout = plan.ranked[0].layout
    assert {k: config["parallel"][k] for k in ("dp", "pp", "sp", "tp")} == {
        "dp": layout.dp,
        "pp": layout.pp,
        "sp": layout.sp,
        "tp": layout.tp,
    }
    assert set(config["train"]) == {
        "micro_batch",
        "global_batch",
        "seq_len",
        "schedule",
        "chunks",
        "recompute",
        "zero",
    }
