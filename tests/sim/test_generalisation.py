"""Leave-one-table-out validation, which tables determine a fitted constant, the never-fitted tables
of other frameworks, and the validation plot's legibility."""

from __future__ import annotations

import csv
from dataclasses import replace

import pytest

from shiftlm.hardware import CATALOG
from shiftlm.presets import PRESETS
from shiftlm.sim.costs import op_sac_gemm_share
from shiftlm.sim.efficiency import FIRST_PRINCIPLES, FITTED, FITTED_CLUSTER
from shiftlm.sim.fit import fit_tables, fittable
from shiftlm.sim.layout import Layout
from shiftlm.sim.loto import determination, leave_one_table_out
from shiftlm.sim.measured import default_data_dir, load_cases
from shiftlm.sim.train import simulate_step
from shiftlm.sim.validate import replay


def _synthetic(gemm: float) -> dict:
    """A few small rows of the two vTrain tables, 'measured' by the simulator at a known `gemm`."""
    cases = load_cases(default_data_dir(), ["vtrain_single_node", "vtrain_multi_node"])
    small = {
        "vtrain_single_node": cases["vtrain_single_node"][:8],
        "vtrain_multi_node": [c for c in cases["vtrain_multi_node"] if c.layout.pp <= 2][:8],
    }
    truth = replace(FIRST_PRINCIPLES, gemm=gemm)
    return {
        table: [replace(case, measured=row.predicted) for case, row in zip(rows, replay(table, rows, truth))]
        for table, rows in small.items()
    }


def test_each_table_is_scored_by_a_refit_that_never_saw_it():
    cases = _synthetic(0.6)
    full, held_out = leave_one_table_out(cases, ("gemm",), (), FIRST_PRINCIPLES, jobs=2)
    assert full.efficiency.gemm == pytest.approx(0.6, abs=0.005)
    assert fit_tables(cases, ("gemm",), (), FIRST_PRINCIPLES) == full  # what `--refit` runs
    for table, result in held_out.items():
        # the other table alone recovers the constant, and it predicts the table left out
        assert result.fit.efficiency.gemm == pytest.approx(0.6, abs=0.005), table
        assert result.mape_pct < 1.0, table
    # no leak: whatever the table left out measured, its refit is the same
    skewed = dict(
        cases, vtrain_multi_node=[replace(c, measured=1.3 * c.measured) for c in cases["vtrain_multi_node"]]
    )
    _, again = leave_one_table_out(skewed, ("gemm",), (), FIRST_PRINCIPLES, jobs=1)
    assert again["vtrain_multi_node"].fit == held_out["vtrain_multi_node"].fit
    assert again["vtrain_multi_node"].mape_pct == pytest.approx(100 * (1 - 1 / 1.3), abs=1.0)


def test_a_shared_constant_only_the_table_left_out_determines_stays_at_its_prior():
    # the single-node table's small-hidden rows are host-bound, the multi-node table's are not: only
    # the former determines the host's time per op, so the refit without it must not invent a value
    truth = replace(FIRST_PRINCIPLES, gemm=0.6, host_op=30e-6)
    cases = {
        table: [replace(c, measured=r.predicted) for c, r in zip(rows, replay(table, rows, truth))]
        for table, rows in _synthetic(0.6).items()
    }
    full, held_out = leave_one_table_out(cases, ("gemm", "host_op"), (), FIRST_PRINCIPLES, jobs=1)
    assert full.efficiency.host_op == pytest.approx(30e-6, rel=0.03)
    assert held_out["vtrain_single_node"].unfitted == ("host_op",)
    assert held_out["vtrain_single_node"].fit.efficiency.host_op == FIRST_PRINCIPLES.host_op
    assert held_out["vtrain_single_node"].fit.efficiency.gemm == pytest.approx(0.6, abs=0.005)
    assert held_out["vtrain_multi_node"].unfitted == ()


def test_a_framework_constant_leaves_with_the_last_table_that_runs_that_framework():
    cases = load_cases(default_data_dir(), ["megatron_2021_table1", "llmfoundry_a100", "torchtitan_h100"])
    names = ("gemm", "attention_kernel@llm-foundry")
    assert fittable(names, cases) == names
    without = {t: rows for t, rows in cases.items() if t != "llmfoundry_a100"}
    assert fittable(names, without) == ("gemm",)  # torchtitan's table runs another framework


def test_a_cluster_interconnect_constant_leaves_with_the_last_table_that_spans_its_nodes():
    cases = load_cases(default_data_dir(), ["vtrain_single_node", "vtrain_multi_node"])
    names = ("gemm", "inter_comm@a100-80gb-vtrain")
    assert fittable(names, cases) == names
    # the single-node table runs on the same cluster but never crosses its InfiniBand
    assert fittable(names, {"vtrain_single_node": cases["vtrain_single_node"]}) == ("gemm",)


def test_determination_counts_only_the_tables_a_constant_moves():
    cases = _synthetic(0.6)
    single = {"vtrain_single_node": cases["vtrain_single_node"]}
    assert all(c.layout.gpus <= 8 for c in single["vtrain_single_node"])
    moved = determination(single, replace(FIRST_PRINCIPLES, gemm=0.6), {}, ("gemm", "inter_comm"), jobs=1)
    assert moved["gemm"]["vtrain_single_node"] > 1.0  # +-20% of gemm moves every row
    assert moved["inter_comm"]["vtrain_single_node"] == 0.0  # one node: no InfiniBand


def test_per_op_selective_checkpointing_recomputes_every_other_matmul():
    model = PRESETS["llama3-8b"]  # wq, wk, wv, wo, w1, w3, w2: recomputes wk, wo, w3
    h, kv, f = 4096, 1024, 14336
    assert op_sac_gemm_share(model) == pytest.approx(
        (h * kv + h * h + h * f) / (2 * h * h + 2 * h * kv + 3 * h * f)
    )
    h100 = CATALOG["h100-sxm"]
    times = {
        mode: simulate_step(
            model,
            Layout(dp=8, zero=3, micro_batch=2, global_batch=16, seq_len=8192, recompute=mode),
            h100,
            FITTED,
            "bf16",
        ).step_time
        for mode in ("selective", "op", "full")
    }
    assert times["selective"] < times["op"] < times["full"]


def test_torchtitan_rows_reproduce_the_mfu_their_page_states():
    """Transcription check: torchtitan's page says its eager bf16 8B runs (FSDP, 8 or 128 H100)
    reach 33% MFU, counted with torchtitan's FLOPs per token (6 x non-embedding parameters
    + 12 x layers x heads x head_dim x sequence) against H100 SXM's 989 TFLOP/s."""
    with (default_data_dir() / "torchtitan_h100_bf16.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [r["techniques"] for r in rows] == ["FSDP", "FSDP"]
    for row in rows:
        model = PRESETS[row["model"]]
        params = model.num_layers * model.layer_params + model.embedding_params  # untied head
        flops = 6 * params + 12 * model.num_layers * model.num_heads * model.head_dim * int(row["seq"])
        mfu = 100 * float(row["tokens_per_s_per_gpu"]) * flops / 989e12
        assert mfu == pytest.approx(33, abs=1), row
        assert int(row["global_batch"]) == int(row["gpus"]) * int(row["local_batch"]) // int(row["tp"])
    assert all(
        c.software == "torchtitan"
        for c in load_cases(default_data_dir(), ["torchtitan_h100"])["torchtitan_h100"]
    )


def test_the_validation_plot_is_a_grid_whose_tick_labels_do_not_overlap():
    from shiftlm.sim.validate_cli import scatter_figure

    tables = load_cases(
        default_data_dir(),
        ["megatron_2021_table1", "korthikanti_2022_table5", "llmfoundry_h100", "torchtitan_h100"],
    )
    rows = {t: replay(t, cases, FITTED, FITTED_CLUSTER) for t, cases in tables.items()}
    fig = scatter_figure(rows, {t: cases[0].metric for t, cases in tables.items()}, {t: "x" for t in rows})
    width, height = fig.get_size_inches()
    assert width / height < 2.5  # a grid, not a strip of panels
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
            boxes = [t.get_window_extent(renderer) for t in labels if t.get_visible() and t.get_text()]
            assert len(boxes) >= 2, ax.get_title()
            for i, a in enumerate(boxes):
                assert not any(a.overlaps(b) for b in boxes[i + 1 :]), ax.get_title()


def test_eager_llama_pointwise_bytes_count_torchtitans_ops():
    """torchtitan's eager Llama block (9dec370) moves, per token and layer of its forward, 2 x 36
    bytes per hidden unit in its RMSNorms (fp32 upcast, pow, mean, rsqrt mul, cast, weight mul),
    2 x 6 in its residual adds, 20 per q and k unit in its fp32 complex RoPE, 4 per q and k unit in
    repeat_kv's copies, 10 per FFN unit in its unfused SwiGLU: beyond the fused kernels'
    22 per hidden and 6 per FFN unit that is 106 bytes per hidden unit for Llama 3 8B."""
    from shiftlm.sim.layout import eager_llama_pointwise_bytes

    llama = PRESETS["llama3-8b"]
    h, f, kv = llama.hidden_size, llama.intermediate_size, llama.kv_dim
    expected = 72 * h + 12 * h + 20 * (h + kv) + 4 * (h + kv) + 10 * f - (22 * h + 6 * f)
    assert eager_llama_pointwise_bytes(llama) == expected == 106 * h
    mha = replace(llama, num_kv_heads=llama.num_heads)  # no repeat_kv copy without GQA
    assert eager_llama_pointwise_bytes(mha) == pytest.approx(
        72 * h + 12 * h + 40 * h + 10 * f - (22 * h + 6 * f)
    )


def test_a_power_cap_scales_the_tensor_core_peak_by_its_cube_root():
    """500 W on a 700 W H100 SXM: 989 x (5/7)^(1/3) = 884 TFLOP/s, between SXM's 989 and NVL's 835 as
    torchtitan's page says; the law gives 821 for NVL's 400 W against its datasheet 835. HBM is not
    throttled."""
    from shiftlm.hardware import power_capped
    from shiftlm.sim.measured import GRAND_TETON

    h100 = CATALOG["h100-sxm"]
    assert GRAND_TETON.flops("bf16") / 1e12 == pytest.approx(884.0, abs=1.0)
    assert 835e12 < GRAND_TETON.flops("bf16") < 989e12
    nvl = power_capped(h100, 400, 700, "nvl-like")
    assert nvl.flops("bf16") == pytest.approx(835e12, rel=0.02)
    assert nvl.hbm_bandwidth == h100.hbm_bandwidth
    with pytest.raises(ValueError):
        power_capped(h100, 800, 700, "over")


def test_torchtitans_eager_ops_cost_what_its_compiled_rows_save():
    """The page's same runs with torch.compile (which fuses the norms, RoPE and SwiGLU to about the
    kernels `forward_ops` lists): Table 1 6,667 and Table 3 6,514 TPS/GPU against the eager 5,762 and
    5,605, i.e. 0.386 s and 0.408 s less per step of 16,384 tokens per GPU. The replay's eager
    pointwise traffic (`Layout.pointwise_bytes`) costs 0.446 s per step: within 20% of both."""
    cases = load_cases(default_data_dir(), ["torchtitan_h100"])["torchtitan_h100"]
    compiled_tps = {8: 6667, 128: 6514}
    for case in cases:
        assert case.layout.pointwise_bytes > 0 and case.layout.optimizer_bytes == 96.0
        tokens = case.layout.micro_batch * case.layout.seq_len
        saved = tokens / case.measured - tokens / compiled_tps[case.layout.gpus]
        fused = replace(case.layout, pointwise_bytes=0.0)
        eager_step = simulate_step(case.model, case.layout, case.hardware, FITTED, "bf16").step_time
        fused_step = simulate_step(case.model, fused, case.hardware, FITTED, "bf16").step_time
        assert eager_step - fused_step == pytest.approx(saved, rel=0.20)


def test_fsdp2s_copies_cost_their_bytes_at_hbm_bandwidth():
    """FSDP2's copy-out of each all-gather (twice: forward and backward) and the gradients' cast into
    the fp32 reduce-scatter input: 14 bytes per unsharded parameter per micro-batch at the memory
    rate; ZeRO-1/2 layouts take none."""
    from shiftlm.sim.memory import stage_params

    case = load_cases(default_data_dir(), ["torchtitan_h100"])["torchtitan_h100"][0]
    assert case.layout.zero3_copy_bytes == 14.0
    without = replace(case.layout, zero3_copy_bytes=0.0)
    step = simulate_step(case.model, case.layout, case.hardware, FITTED, "bf16").step_time
    base = simulate_step(case.model, without, case.hardware, FITTED, "bf16").step_time
    expected = 14.0 * stage_params(case.model, case.layout) / (case.hardware.hbm_bandwidth * FITTED.memory)
    assert step - base == pytest.approx(expected, rel=1e-6)
    zero1 = replace(case.layout, zero=1)
    assert simulate_step(case.model, zero1, case.hardware, FITTED, "bf16").step_time == pytest.approx(
        simulate_step(
            case.model, replace(zero1, zero3_copy_bytes=0.0), case.hardware, FITTED, "bf16"
        ).step_time
    )
