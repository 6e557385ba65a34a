"""Validation error on the measured tables, the fitter, and the planner's exactness."""

from __future__ import annotations

from dataclasses import replace

import pytest
import tomllib
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftlm.hardware import CATALOG
from shiftlm.pipeline.peak import lowered_schedule as build
from shiftlm.pipeline.simulator import ActionCosts, simulate
from shiftlm.presets import PRESETS
from shiftlm.sim.critical_path import critical_path
from shiftlm.sim.efficiency import FIRST_PRINCIPLES, FIT_PARAMETERS, FITTED, FITTED_CLUSTER
from shiftlm.sim.fit import fit
from shiftlm.sim.layout import Layout
from shiftlm.sim.measured import default_data_dir, load_cases
from shiftlm.sim.pipeline_timing import pipeline_timing
from shiftlm.sim.planner import enumerate_layouts, plan_training, step_time_bound, train_config_toml
from shiftlm.sim.train import simulate_step, stage_costs, step_stage_costs
from shiftlm.sim.validate import is_fit_row, mape, percentile_abs_error, replay, table_summary
from shiftlm.sim.validate_cli import TARGET_P90_PCT, TARGET_PCT


def _held_out(table):
    rows = replay(table, load_cases(default_data_dir(), [table])[table], FITTED, FITTED_CLUSTER)
    return [row for row in rows if not row.fit_row]


MET_TODAY = {  # issue 17's held-out goals (validate_cli.TARGET_PCT): which are met today
    "megatron_2021_table1": True,  # 2.90% (2.88% with 10 fitted constants)
    "korthikanti_2022_table5": True,  # 2.84% (3.06% with 7, 2.50% with 10)
    # 8.26% since 2026-11-28: the price of one InfiniBand share for every cluster (issue 33's
    # parsimony; 6.89% with vTrain's own share, which only this table determined)
    "vtrain_multi_node": False,
    # 7.76% (goal 8%), but p90 15.8% (goal 15%) since 2026-11-28: `host_op` (22.6 us) and `gemm` (0.866)
    # now also answer to the MoE table's runs (14.7% p90 when this table alone determined `host_op`)
    "vtrain_single_node": False,
    # its odd rows: llm-foundry's two constants are fitted on the even rows of its H100 and A100 tables
    "llmfoundry_h100": True,
}


@pytest.mark.parametrize(
    "table",
    [
        pytest.param(t, marks=[] if met else pytest.mark.xfail(strict=True, reason="goal not met yet"))
        for t, met in MET_TODAY.items()
    ],
)
def test_fitted_model_meets_the_issue_goal_on_held_out_rows(table):
    # strict xfail: a goal not met today fails the suite the day it is met, so the mark comes off
    bound, p90_bound = TARGET_PCT[table], TARGET_P90_PCT.get(table)
    held_out = _held_out(table)
    assert held_out and mape(held_out) <= bound
    if p90_bound is not None:
        assert percentile_abs_error(held_out, 90) <= p90_bound


@pytest.mark.parametrize(
    "table, bound",
    [
        # where a goal is not met, the bound is today's value plus a little: a regression fails
        ("megatron_2021_table1", 4.0),
        ("korthikanti_2022_table5", 3.0),
        ("vtrain_multi_node", 8.5),
        ("vtrain_single_node", 8.0),
        ("llmfoundry_h100", 8.0),
        # no goal: the same framework on A100 (6.41% since its constants are fitted on both
        # generations; 5.51% when only this table fitted them)
        ("llmfoundry_a100", 6.6),
    ],
)
def test_fitted_model_stays_within_its_held_out_error(table, bound):
    # only the rows the fit never saw (is_fit_row is False)
    held_out = _held_out(table)
    assert held_out and mape(held_out) <= bound


def test_torchtitan_is_never_fitted_and_llm_foundry_only_for_its_framework():
    cases = load_cases(default_data_dir(), ["llmfoundry_h100", "llmfoundry_a100", "torchtitan_h100"])
    assert len(cases["llmfoundry_h100"]) == 52 and len(_held_out("llmfoundry_h100")) == 26
    assert len(cases["torchtitan_h100"]) == 2 and len(_held_out("torchtitan_h100")) == 2
    assert len(cases["llmfoundry_a100"]) == 44 and len(_held_out("llmfoundry_a100")) == 22
    # llm-foundry's fit rows (both GPU generations) fit only its own parameters: stage 1 (the
    # shared constants) of `simulate validate --refit` sees no table with a framework
    assert all(
        case.software == "llm-foundry" for t in ("llmfoundry_h100", "llmfoundry_a100") for case in cases[t]
    )
    assert "attention_kernel@llm-foundry" in FITTED_CLUSTER and "attention_kernel" not in FIT_PARAMETERS


def test_the_host_bound_runs_of_two_tables_are_in_the_fit():
    # `host_op` needs two tables (issue 33): vTrain single-node's small models and the MoE table's
    # Qwen3 TP4 EP8 row; the MoE table's Qwen3 TP2 EP32 row is its held-out one
    cases = load_cases(default_data_dir(), ["megatron_core_moe_h100"])["megatron_core_moe_h100"]
    fit_rows = [case.label for index, case in enumerate(cases) if is_fit_row("megatron_core_moe_h100", index)]
    assert len(fit_rows) == 2 and "qwen3" in fit_rows[1] and "tp4 ep8" in fit_rows[1]
    assert [row.label for row in _held_out("megatron_core_moe_h100")] == [cases[1].label]
    assert "host_op" in FIT_PARAMETERS and not any("@" in name for name in FIT_PARAMETERS)


def test_a_software_parameter_applies_to_its_framework_on_every_gpu_and_nowhere_else():
    from shiftlm.sim.validate import on_cluster

    tables = load_cases(default_data_dir(), ["llmfoundry_h100", "llmfoundry_a100", "megatron_2021_table1"])
    for table, cases in tables.items():
        share = on_cluster(FITTED, cases[0], FITTED_CLUSTER).attention_kernel
        assert share == (FITTED_CLUSTER["attention_kernel@llm-foundry"] if "llmfoundry" in table else 1.0)


def test_attention_kernel_share_scales_only_the_attention_kernel():
    from shiftlm.sim import costs

    model, h100 = PRESETS["llama3-8b"], CATALOG["h100-sxm"]
    ops = costs.forward_ops(model, 1, 32768, 32768, costs.Shard())
    attention = [op for op in ops if op.role == "attention"]
    others = [op for op in ops if op.role != "attention"]
    half = replace(FITTED, attention_kernel=0.5)
    t = costs.kernels_time
    assert t(others, h100, half, "bf16") == pytest.approx(t(others, h100, FITTED, "bf16"))
    slow, fast = t(attention, h100, half, "bf16"), t(attention, h100, FITTED, "bf16")
    assert slow - FITTED.kernel_overhead == pytest.approx(2 * (fast - FITTED.kernel_overhead), rel=1e-6)


def test_framework_activation_traffic_costs_its_bytes_per_token_and_layer():
    from shiftlm.sim.validate import on_cluster

    case = load_cases(default_data_dir(), ["llmfoundry_a100"])["llmfoundry_a100"][5]  # 30b s1024, 8 GPUs
    model, layout, a100 = case.model, case.layout, case.hardware
    efficiency = on_cluster(FITTED, case, FITTED_CLUSTER)
    quiet = replace(efficiency, activation_bytes=0.0)
    extra = simulate_step(model, layout, a100, efficiency, "bf16").step_time
    extra -= simulate_step(model, layout, a100, quiet, "bf16").step_time
    tokens = layout.micro_batch * layout.seq_len
    forward = efficiency.activation_bytes * tokens * model.hidden_size * model.num_layers
    forward /= a100.hbm_bandwidth * efficiency.memory
    assert layout.recompute == "full"  # forward + backward (2x) + the recomputed forward
    assert extra == pytest.approx(layout.microbatches * 4 * forward, rel=0.02)
    assert FITTED.activation_bytes == 0.0  # shiftlm's and Megatron's kernels are what the model lists


def test_fit_recovers_a_known_attention_kernel_share_from_synthetic_measurements():
    cases = load_cases(default_data_dir(), ["llmfoundry_a100"])["llmfoundry_a100"]
    truth = {"attention_kernel@llm-foundry": 0.4}
    synthetic = [
        replace(case, measured=row.predicted)
        for case, row in zip(cases, replay("llmfoundry_a100", cases, FITTED, truth))
    ]
    result = fit({"llmfoundry_a100": synthetic}, FITTED, parameters=tuple(truth), sweeps=1)
    assert result.clusters["attention_kernel@llm-foundry"] == pytest.approx(0.4, abs=0.005)


def test_llmfoundry_a100_rows_reproduce_their_published_mfu():
    """Transcription check of the A100 table: each row's tokens/s per GPU gives the MFU published
    beside it by llm-foundry's formula (3 x (2 N + 4 l d s) FLOPs per token; N from d_model, layers
    and vocab, within 0.5% of the published parameter counts)."""
    import csv

    with (default_data_dir() / "llmfoundry_a100_bf16.csv").open() as handle:
        for row in csv.DictReader(handle):
            d, layers, s = int(row["d_model"]), int(row["n_layers"]), int(row["seq"])
            params = layers * 12 * d * d + int(row["vocab"]) * d
            flops_per_token = 3 * (2 * params + 4 * layers * d * s)
            mfu = float(row["tokens_per_s_per_gpu"]) * flops_per_token / CATALOG["a100-80gb"].flops("bf16")
            assert 100 * mfu == pytest.approx(float(row["mfu_pct"]), rel=0.02), row


@pytest.mark.parametrize("family", ["tp>1", "pp>1", "dp>1"])
def test_no_layout_family_of_vtrain_single_node_hides_in_the_average(family):
    table = "vtrain_single_node"
    rows = replay(table, load_cases(default_data_dir(), [table])[table], FITTED, FITTED_CLUSTER)
    summary = table_summary(rows)["families_held_out"][family]
    assert summary["rows"] > 50 and summary["mape_held_out_pct"] <= 9.0


def test_megatron_2021_gradient_accumulation_costs_its_bytes_on_every_micro_batch_after_the_first():
    table = "megatron_2021_table1"
    case = load_cases(default_data_dir(), [table])[table][8]  # 530B tp8 pp35 dp9 v3, 280 micro-batches
    layout, a100 = case.layout, case.hardware
    assert layout.grad_accumulation_bytes == 6.0 and layout.microbatches == 280
    fused = replace(layout, grad_accumulation_bytes=0.0)
    args = (case.model, a100, FITTED, case.dtype)
    stage = step_stage_costs(case.model, layout, *args[1:])
    plain = step_stage_costs(case.model, fused, *args[1:])
    extra = sum(w - p for w, p in zip(stage.backward_weight, plain.backward_weight))
    params = case.model.num_layers * case.model.layer_params + 2 * case.model.embedding_params
    expected = 6.0 * 279 / 280 * params / layout.tp / (a100.hbm_bandwidth * FITTED.memory)
    assert extra == pytest.approx(expected, rel=1e-9)  # per micro-batch, summed over the stage-chunks
    slower = simulate_step(case.model, layout, *args[1:]).step_time
    assert slower > simulate_step(case.model, fused, *args[1:]).step_time
    # the later Megatron-LM of Korthikanti's and vTrain's runs accumulates inside the GEMM
    for other in ("korthikanti_2022_table5", "vtrain_multi_node"):
        assert all(
            c.layout.grad_accumulation_bytes == 0 for c in load_cases(default_data_dir(), [other])[other]
        )


def test_optimizer_step_costs_its_bytes_per_local_parameter():
    from shiftlm.sim.costs import optimizer_time

    a100 = CATALOG["a100-80gb"]
    assert optimizer_time(1e9, a100, FITTED, 52.0) == pytest.approx(
        52 / 30 * optimizer_time(1e9, a100, FITTED)
    )
    for rows in load_cases(default_data_dir(), ["megatron_2021_table1", "vtrain_single_node"]).values():
        assert all(c.layout.optimizer_bytes == 52.0 for c in rows)  # Megatron-LM's fp16 optimizer
    assert Layout().optimizer_bytes == 30.0  # a fused mixed-precision Adam


def test_every_megatron_table1_row_is_within_10_percent():
    table = "megatron_2021_table1"
    for row in replay(table, load_cases(default_data_dir(), [table])[table], FITTED, FITTED_CLUSTER):
        assert abs(row.error) <= 0.10, row


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
    result = fit({"vtrain_multi_node": synthetic}, FIRST_PRINCIPLES, parameters=("gemm",), sweeps=1, steps=14)
    assert result.efficiency.gemm == pytest.approx(0.6, abs=0.01)
    assert result.objective_pct < 0.5


def test_planner_top_layout_is_the_fastest_that_fits_among_all_candidates():
    model, h100 = PRESETS["qwen2.5-7b"], CATALOG["h100-sxm"]
    plan = plan_training(model, h100, gpus=8, seq_len=4096, global_batch=16, top_k=1)
    from shiftlm.sim.train import trainer_split
    from shiftlm.sim.trainer_costs import trainer_step_memory

    # compiled blocks (the planner's default), the zero-bubble schedules' split micro-batches eager
    split = trainer_split(model, 2, True, FIRST_PRINCIPLES)
    exhaustive = [
        (simulate_step(model, layout, h100, FIRST_PRINCIPLES, "bf16", split), layout)
        for layout in enumerate_layouts(model, 8, h100.gpus_per_node, 4096, 16)
    ]
    # fits as the trainer keeps its states (what the planner checks)
    best = min(
        r.step_time for r, lay in exhaustive if trainer_step_memory(model, lay, h100.hbm_bytes, 2).fits
    )
    assert plan.ranked[0].result.step_time == pytest.approx(best)
    assert plan.simulated < len(exhaustive)


LLAMA_8B, H100 = PRESETS["llama3-8b"], CATALOG["h100-sxm"]


@settings(max_examples=25, deadline=None)
@given(
    schedule=st.sampled_from(["1f1b", "zb_h1", "zb_v", "interleaved_1f1b"]),
    pp=st.sampled_from([2, 4]),
    rounds=st.integers(1, 4),
    micro_batch=st.sampled_from([1, 2]),
    recompute=st.sampled_from(["selective", "full"]),
)
def test_step_time_bound_never_exceeds_the_simulated_makespan(schedule, pp, rounds, micro_batch, recompute):
    chunks = 1 if schedule in ("1f1b", "zb_h1") else 2
    microbatches = pp * rounds  # interleaved 1F1B needs a multiple of pp
    layout = Layout(
        dp=1,
        pp=pp,
        tp=2,
        sp=1,
        micro_batch=micro_batch,
        global_batch=microbatches * micro_batch,
        seq_len=2048,
        schedule=schedule,
        chunks=chunks,
        recompute=recompute,
    )
    stage = stage_costs(LLAMA_8B, layout, H100, FIRST_PRINCIPLES, "bf16", pp * chunks)
    # the bound and the simulator sum the same costs in different orders: 1e-12 is float round-off
    assert step_time_bound(layout, stage) <= pipeline_timing(layout, stage).makespan * (1 + 1e-9)


def test_memoised_pipeline_timing_scales_with_the_costs():
    layout = Layout(
        dp=1, pp=4, tp=1, sp=1, micro_batch=1, global_batch=8, seq_len=2048, schedule="zb_v", chunks=2
    )
    stage = stage_costs(LLAMA_8B, layout, H100, FIRST_PRINCIPLES, "bf16", 8)
    doubled = replace(
        stage,
        forward=[2 * c for c in stage.forward],
        backward_input=[2 * c for c in stage.backward_input],
        backward_weight=[2 * c for c in stage.backward_weight],
        p2p=2 * stage.p2p,
    )
    assert pipeline_timing(layout, doubled).makespan == pytest.approx(
        2 * pipeline_timing(layout, stage).makespan
    )


@settings(max_examples=20, deadline=None)
@given(
    schedule=st.sampled_from(["1f1b", "zb_h1", "zb_v", "gpipe"]),
    costs=st.lists(st.floats(0.1, 3.0), min_size=4, max_size=4),
)
def test_critical_path_length_equals_the_makespan(schedule, costs):
    chunks = 2 if schedule == "zb_v" else 1
    plan = build(schedule, 3, 5, chunks)
    forward, backward_input, backward_weight = (
        [c * (1 + s / 7) for s in range(3 * chunks)] for c in costs[:3]
    )
    result = simulate(plan, ActionCosts(forward, backward_input, backward_weight, p2p=costs[3]))
    path = critical_path(plan, result, costs[3])
    assert path.length(forward, backward_input, backward_weight, costs[3]) == pytest.approx(result.makespan)


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
