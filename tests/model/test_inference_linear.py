"""Inference linears (oneDNN, plain or packed weights) compute what `F.linear` computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shiftlm.model.inference_linear import (
    GEMV_ROWS,
    ONEDNN_DTYPES,
    PackedWeights,
    inference_linear,
    inference_linears,
)

needs_onednn = pytest.mark.skipif(torch.float32 not in ONEDNN_DTYPES, reason="oneDNN is not available")


def _weights() -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 40), torch.randn(48)
    return {
        "whole": (weight, bias),
        "row view": (weight.narrow(0, 16, 16), bias.narrow(0, 16, 16)),  # full-TP's q/k/v/gate/up
        "column view": (weight.narrow(1, 20, 20), None),  # full-TP's o/down: a strided weight
    }


@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("packed", [False, True])
def test_inference_linear_equals_f_linear_on_weights_and_views(rows, packed):
    weights = _weights()
    cache = PackedWeights()
    for name, (weight, bias) in weights.items():
        x = torch.randn(1, rows, weight.shape[1])
        out = inference_linear(x, weight, bias, cache if packed else None)
        torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5, msg=name)
    if packed and torch.float32 in ONEDNN_DTYPES:
        # one copy per view (the two views of one storage differ); none for GEMV-sized inputs (MKL)
        assert len(cache) == (len(weights) if rows > GEMV_ROWS else 0)


@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("packed", [False, True])
def test_fused_linears_equal_each_linear(rows, packed):
    """Q|K|V-style fusion: one GEMM on the concatenated (packed) weights, split back, equals each
    `F.linear`; a missing bias among present ones is zeros; the fused copy is made once."""
    torch.manual_seed(1)
    base = torch.randn(40, 24)
    weights = (base.narrow(0, 0, 24), base.narrow(0, 24, 8), torch.randn(8, 24))
    biases = (torch.randn(24), None, torch.randn(8))
    cache = PackedWeights()
    x = torch.randn(1, rows, 24)
    with torch.no_grad():
        for _ in range(2):
            outs = inference_linears(x, weights, biases, cache if packed else None)
    for out, weight, bias in zip(outs, weights, biases):
        torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    fused = packed and torch.float32 in ONEDNN_DTYPES and rows > GEMV_ROWS
    assert len(cache) == (1 if fused else 0)
    if fused:  # the outputs are views of one GEMM's output, q and k adjacent (apply_rope_qk's one pass)
        assert outs[1].data_ptr() == outs[0].data_ptr() + 24 * outs[0].element_size()


@needs_onednn
def test_packed_copies_are_made_once_and_only_where_given():
    weight = torch.randn(24, 16)
    cache = PackedWeights()
    inference_linear(torch.randn(3, 16), weight)
    assert len(cache) == 0
    for rows in (1, 5, 64):
        inference_linear(torch.randn(rows, 16), weight, packed=cache)
    assert len(cache) == 1


def test_other_dtypes_fall_back_to_f_linear():
    weight, x = torch.randn(8, 6, dtype=torch.float64), torch.randn(2, 6, dtype=torch.float64)
    assert torch.equal(inference_linear(x, weight), F.linear(x, weight))


@needs_onednn
@pytest.mark.parametrize("gemv_rows", [0, 1, 2])
def test_small_inputs_take_the_path_gemv_rows_names(gemv_rows):
    """Inputs of at most `gemv_rows` rows run MKL on the weight as it is (no packed copy), larger ones
    oneDNN on a packed copy; both compute F.linear."""
    weight = torch.randn(24, 16)
    for rows in (1, 2, 3):
        cache = PackedWeights(gemv_rows=gemv_rows)
        x = torch.randn(rows, 16)
        out = inference_linear(x, weight, packed=cache)
        torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)
        assert len(cache) == (0 if rows <= gemv_rows else 1), rows


@needs_onednn
@pytest.mark.parametrize("slow", ["mkl", "onednn"])
def test_choose_small_rows_keeps_the_faster_path(monkeypatch, slow):
    """The probe times both paths on the given weights and keeps MKL only where it is faster: made
    slow by a sleep, a path loses; the choice drives `inference_linear`."""
    import time

    import shiftlm.model.inference_linear as il

    layers = [[(torch.randn(32, 16), torch.randn(8, 16)), (torch.randn(16, 32),)]]
    if slow == "mkl":
        fast = F.linear
        monkeypatch.setattr(il.F, "linear", lambda *a: (time.sleep(0.02), fast(*a))[1])
    elif slow == "onednn":
        fast = il._onednn_linear
        monkeypatch.setattr(il, "_onednn_linear", lambda *a: (time.sleep(0.02), fast(*a))[1])
    cache = PackedWeights()
    chosen = cache.choose_small_rows(layers, reps=3)
    assert chosen == cache.gemv_rows
    assert chosen == (0 if slow == "mkl" else il.GEMV_ROWS)
    assert len(cache) == 0  # the probe's packed copies are its own
