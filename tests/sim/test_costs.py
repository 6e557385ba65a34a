"""The cost model reproduces the published FLOP and activation formulas it is built from."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftlm.sim import costs
from shiftlm.sim.layout import Layout
from shiftlm.sim.memory import layer_activation_bytes
from shiftlm.sim.models import PRESETS, gpt_style

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
    h, layers, vocab = model.hidden, model.layers, model.vocab
    per_token = 72 * layers * h * h * (1 + seq / (6 * h) + vocab / (12 * layers * h))
    assert costs.model_flops_per_token(model, seq) == pytest.approx(per_token, rel=1e-9)


def test_flash_attention_halves_causal_attention_flops():
    model = gpt_style(4096, 1, 32)
    full = costs.forward_ops(model, 1, 4096, 4096, costs.Shard(flash_attention=False))
    flash = costs.forward_ops(model, 1, 4096, 4096, costs.Shard(flash_attention=True))
    attention = sum(op.flops for op in full if op.name in ("qk", "av"))
    assert sum(op.flops for op in flash if op.name == "flash_attention") == pytest.approx(attention / 2)


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_activation_bytes_match_korthikanti_table2(tp):
    model = gpt_style(6144, 4, 48)
    s, b, h, a = 2048, 2, model.hidden, model.heads
    base = Layout(dp=1, pp=1, tp=tp, micro_batch=b, seq_len=s, flash_attention=False)
    plain = Layout(**{**base.__dict__, "recompute": "none", "tp_sequence_parallel": False})
    assert layer_activation_bytes(model, plain) == pytest.approx(
        s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    )
    selective_sp = Layout(**{**base.__dict__, "recompute": "selective", "tp_sequence_parallel": True})
    assert layer_activation_bytes(model, selective_sp) == pytest.approx(34 * s * b * h / tp)
    full = Layout(**{**base.__dict__, "recompute": "full", "tp_sequence_parallel": False})
    assert layer_activation_bytes(model, full) == pytest.approx(2 * s * b * h)


def test_decode_gemms_are_memory_bound_and_prefill_gemms_compute_bound():
    """The roofline a serving runner relies on: one token per sequence reads all weights."""
    from shiftlm.sim.efficiency import FIRST_PRINCIPLES
    from shiftlm.sim.hardware import CATALOG

    model, h100 = PRESETS["llama3-8b"], CATALOG["h100-sxm"]
    peak, bandwidth = h100.flops("bf16") * FIRST_PRINCIPLES.gemm, h100.hbm_bandwidth * FIRST_PRINCIPLES.memory
    for tokens, memory_bound in ((1, True), (4096, False)):
        mlp = next(
            op for op in costs.forward_ops(model, 1, tokens, 4096, costs.Shard()) if op.name == "mlp_in"
        )
        assert (mlp.nbytes / bandwidth > mlp.flops / peak) is memory_bound
