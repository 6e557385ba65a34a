"""The cost model reproduces the published FLOP and activation formulas it is built from."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftlm.presets import PRESETS, gpt_style
from shiftlm.sim import costs
from shiftlm.sim.layout import Layout
from shiftlm.sim.memory import layer_activation_bytes

dims = st.sampled_from([(1024, 16), (4096, 32), (12288, 96)])


@settings(max_examples=20, deadline=None)
@given(dims=dims, batch=st.integers(1, 8), seq=st.sampled_from([512, 2048]), tp=st.sampled_from([1, 2, 8]))
def test_gpt_layer_forward_flops_are_narayanan_24bsh2_plus_4bs2h(dims, batch, seq, tp):
    hidden, heads = dims
    model = gpt_style(hidden, 4, heads)
    shard = costs.Shard(tp=tp, flash_attention=False)
    flops = sum(op.flops for op in costs.forward_ops(model, batch, seq, seq, shard))
    expected = (24 * batch * seq * hidden**2 + 4 * batch * seq**2 * hidden) / tp
    assert flops == pytest.approx(expected, rel=1e-9)


def test_model_flops_match_the_korthikanti_mfu_formula():
    model, seq = gpt_style(12288, 96, 96, vocab=51200), 2048
    h, layers, vocab = model.hidden_size, model.num_layers, model.vocab_size
    per_token = 72 * layers * h * h * (1 + seq / (6 * h) + vocab / (12 * layers * h))
    assert model.flops_per_token(seq) == pytest.approx(per_token, rel=1e-9)


def test_flash_attention_halves_causal_attention_flops():
    model = gpt_style(4096, 1, 32)
    full = costs.forward_ops(model, 1, 4096, 4096, costs.Shard(flash_attention=False))
    flash = costs.forward_ops(model, 1, 4096, 4096, costs.Shard(flash_attention=True))
    attention = sum(op.flops for op in full if op.name in ("qk", "av"))
    assert sum(op.flops for op in flash if op.name == "flash_attention") == pytest.approx(attention / 2)


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_activation_bytes_match_korthikanti_table2(tp):
    model = gpt_style(6144, 4, 48)
    s, b, h, a = 2048, 2, model.hidden_size, model.num_heads
    base = Layout(dp=1, pp=1, tp=tp, micro_batch=b, seq_len=s, flash_attention=False)
    plain = Layout(**{**base.__dict__, "recompute": "none", "sequence_parallel": False})
    assert layer_activation_bytes(model, plain) == pytest.approx(
        s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    )
    selective_sp = Layout(**{**base.__dict__, "recompute": "selective", "sequence_parallel": True})
    assert layer_activation_bytes(model, selective_sp) == pytest.approx(34 * s * b * h / tp)
    full = Layout(**{**base.__dict__, "recompute": "full", "sequence_parallel": False})
    assert layer_activation_bytes(model, full) == pytest.approx(2 * s * b * h)


def test_decode_gemms_are_memory_bound_and_prefill_gemms_compute_bound():
    """The roofline a serving runner relies on: one token per sequence reads all weights."""
    from shiftlm.hardware import CATALOG
    from shiftlm.sim.efficiency import FIRST_PRINCIPLES

    model, h100 = PRESETS["llama3-8b"], CATALOG["h100-sxm"]
    peak = h100.achievable_flops("bf16") * FIRST_PRINCIPLES.gemm
    bandwidth = h100.hbm_bandwidth * FIRST_PRINCIPLES.memory
    for tokens, memory_bound in ((1, True), (4096, False)):
        mlp = next(
            op for op in costs.forward_ops(model, 1, tokens, 4096, costs.Shard()) if op.name == "mlp_in"
        )
        assert (mlp.nbytes / bandwidth > mlp.flops / peak) is memory_bound


@pytest.mark.parametrize(
    "name, peak_tflops, mamf_tflops",
    # S. Bekman's MAMF table (shiftlm/hardware.py): the best-shape matmul each generation reaches
    [("a100-80gb", 312, 271.2), ("h100-sxm", 989, 794.5), ("h200", 989, 794.5), ("b200", 2250, 1745.0)],
)
def test_a_large_gemm_runs_at_the_fitted_share_of_each_generations_published_achievable_rate(
    name, peak_tflops, mamf_tflops
):
    from shiftlm.hardware import CATALOG
    from shiftlm.sim.efficiency import FITTED

    gpu = CATALOG[name]
    gemm = costs.Kernel("big", 2 * 8192**3, 2 * 3 * 8192**2, True, (8192, 8192, 8192))
    seconds = costs.kernels_time([gemm], gpu, FITTED, "bf16") - FITTED.kernel_overhead
    achieved = gemm.flops / seconds / 1e12
    assert achieved == pytest.approx(FITTED.gemm * mamf_tflops, rel=2e-3)
    assert achieved < peak_tflops


def test_flash_attention_runs_at_flashattention2s_published_share_on_hopper():
    """FlashAttention-2 reaches up to 225 TFLOP/s on A100 but 335 on H100 (Dao 2023, Sec. 4.1): on
    Hopper the attention kernels, not the GEMMs, are the slow part of a long sequence."""
    from shiftlm.hardware import CATALOG
    from shiftlm.sim.efficiency import FITTED

    model = PRESETS["llama3-8b"]
    ops = costs.forward_ops(model, 1, 32768, 32768, costs.Shard())
    attention = next(op for op in ops if op.name == "flash_attention")
    for name, tflops in (("a100-80gb", 225), ("h100-sxm", 335)):
        seconds = costs.kernels_time([attention], CATALOG[name], FITTED, "bf16") - FITTED.kernel_overhead
        assert attention.flops / seconds / 1e12 == pytest.approx(FITTED.gemm * tflops, rel=5e-3)


def _profile_with_table(tmp_path):
    """A calibrated-style profile: forward GEMMs at 100 GFLOP/s for 128 rows and 200 for 512 rows,
    dgrad at half and wgrad at a quarter of the forward rate; written and read back as JSON."""
    from dataclasses import replace

    from shiftlm.hardware import CATALOG, load_profile, save_profile

    table = tuple(
        (role, rows, 1024, 1024, rate * scale)
        for role, scale in (("forward", 1.0), ("dgrad", 0.5), ("wgrad", 0.25))
        for rows, rate in ((128, 100e9), (512, 200e9))
    )
    save_profile(replace(CATALOG["h100-sxm"], name="this", gemm_table=table), tmp_path / "this.json")
    return load_profile(tmp_path / "this.json")


def test_gemm_table_rates_by_shape_and_role(tmp_path):
    hardware = _profile_with_table(tmp_path)
    assert hardware.gemm_rate("forward", 128, 1024, 1024) == 100e9
    assert hardware.gemm_rate("forward", 400, 1000, 1100) == 200e9  # nearest in log space: 512 rows
    assert hardware.gemm_rate("wgrad", 100, 1024, 1024) == 25e9
    from shiftlm.hardware import CATALOG

    assert CATALOG["a100-80gb"].gemm_rate("forward", 128, 1024, 1024) is None  # datasheet peak instead


def test_layer_passes_time_dgrad_and_wgrad_at_their_measured_rates(tmp_path):
    """With a GEMM table, I's GEMMs run at the dgrad rate and W's at the wgrad rate; without one,
    both run at the forward's (peak x efficiency), as the validated catalog model always did."""
    from dataclasses import replace

    from shiftlm.sim.efficiency import MEASURED

    hardware = _profile_with_table(tmp_path)
    model = gpt_style(hidden=1024, layers=2, heads=16, vocab=1024, ffn=1024)
    gemms = [
        op
        for op in costs.forward_ops(model, 1, 128, 128, costs.Shard(dtype_bytes=4))
        if op.name in ("qkv", "out_proj", "mlp_in", "mlp_out")
    ]
    forward = costs.kernels_time(gemms, hardware, MEASURED, "fp32")
    wgrad = costs.kernels_time(costs.backward_gemms(gemms, "wgrad"), hardware, MEASURED, "fp32")
    passes = costs.layer_pass_costs(
        model, 1, 128, costs.Shard(dtype_bytes=4), "none", hardware, MEASURED, "fp32", 0.0
    )
    assert passes.backward_weight == pytest.approx(wgrad) and wgrad > 3.5 * forward
    catalog = replace(hardware, gemm_table=())
    plain = costs.layer_pass_costs(
        model, 1, 128, costs.Shard(dtype_bytes=4), "none", catalog, MEASURED, "fp32", 0.0
    )
    assert plain.backward_weight == pytest.approx(costs.kernels_time(gemms, catalog, MEASURED, "fp32"))


def test_host_bound_layer_takes_the_host_time_and_a_large_one_the_device_time():
    from dataclasses import replace

    from shiftlm.hardware import CATALOG
    from shiftlm.sim.efficiency import FITTED

    a100 = CATALOG["a100-80gb"]
    slow_host = replace(FITTED, host_op=1e-3, host_overlap=8.0)  # 1 ms per op: the host dominates
    small = costs.layer_pass_costs(
        gpt_style(1024, 1, 16), 1, 1024, costs.Shard(tp=1), "none", a100, slow_host, "fp16", 0.0
    )
    assert small.forward == pytest.approx(costs.LAYER_OPS_FORWARD * 1e-3, rel=0.01)
    big_model = gpt_style(12288, 1, 96)
    big = costs.layer_pass_costs(big_model, 8, 2048, costs.Shard(tp=1), "none", a100, FITTED, "fp16", 0.0)
    no_host = costs.layer_pass_costs(
        big_model, 8, 2048, costs.Shard(tp=1), "none", a100, replace(FITTED, host_op=0.0), "fp16", 0.0
    )
    assert big.forward == pytest.approx(no_host.forward, rel=1e-3)


def test_overlap_lies_between_the_longer_stream_and_the_sum():
    assert costs.overlapped(3.0, 4.0, 1.0) == pytest.approx(7.0)
    assert costs.overlapped(3.0, 4.0, 2.0) == pytest.approx(5.0)
    assert 4.0 < costs.overlapped(3.0, 4.0, 5.24) < 4.3
    assert costs.overlapped(3.0, 0.0, 2.0) == 3.0
