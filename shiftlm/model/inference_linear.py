"""Linear layers without autograd (serving): oneDNN's matmul on CPU, optionally on prepacked weights.

On this machine's AVX-512 cores oneDNN runs the fp32 GEMMs of a hidden-512 model ~2.3x faster than
`F.linear` (MKL) at 32-512 rows and as fast at 1 row, on the weight as it is (views included). A copy
of the weight in oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`) makes a whole
decode step ~25% faster at 1 sequence and ~15% at 32 (docs/serving.md "Decode step"); it costs one
more copy of each weight a mode uses, so only callers that ask for it get it (`PackedWeights`).
Everything else falls back to `F.linear`: other devices, dtypes oneDNN lacks here. So do inputs of at
most `GEMV_ROWS` rows (a 1-sequence decode step): there both are bound by reading the weight, and MKL's
GEMV skips oneDNN's ~11 us of fixed cost per call (hidden-512 model's 5 GEMMs a layer, 1 row, hot:
845 vs 987 us; from 4 rows on oneDNN wins, 998 vs 1626).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F


def _onednn_dtypes() -> frozenset[torch.dtype]:
    if not torch.backends.mkldnn.is_available():
        return frozenset()
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return frozenset({torch.float32, torch.bfloat16} if bf16 else {torch.float32})


ONEDNN_DTYPES = _onednn_dtypes()
GEMV_ROWS = 2  # inputs of at most this many rows run MKL's F.linear on the weights as they are
PACK_ROWS = 32  # the row count oneDNN tunes a packed layout for; measured as good from 1 to 512 rows
_active = threading.local()  # .packed: the PackedWeights of the forward running on this thread


class PackedWeights:
    """oneDNN-layout copies of the weights used inside `with packed.active():`, made on first use.

    Keyed by the weight's storage address, shape and strides, so a view (full-TP's head slices) gets a
    copy of its own. The weights must not change while the copies are in use (serving's are frozen)."""

    def __init__(self, ops=None) -> None:
        self._copies: dict[tuple, torch.Tensor] = {}
        # the CPU kernels (model/cpu_kernels.py) the forward inside `active()` may use for its fused
        # RMSNorm and SwiGLU; None: PyTorch's ops
        self.ops = ops

    def __len__(self) -> int:
        return len(self._copies)

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = _key(weight)
        packed = self._copies.get(key)
        if packed is None:
            packed = self._copies[key] = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
        return packed

    def get_fused(
        self, weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One packed weight for several linears of the same input (rows concatenated: Q|K|V, gate|up),
        and their concatenated bias (None when none has one; zeros stand in for a missing one)."""
        key = tuple(_key(w) for w in weights) + tuple(None if b is None else _key(b) for b in biases)
        fused = self._copies.get(key)
        if fused is None:
            weight = torch.ops.mkldnn._reorder_linear_weight(torch.cat(weights), PACK_ROWS)
            bias = None
            if any(b is not None for b in biases):
                parts = [w.new_zeros(w.shape[0]) if b is None else b for w, b in zip(weights, biases)]
                bias = torch.cat(parts)
            fused = self._copies[key] = (weight, bias)
        return fused

    @contextmanager
    def active(self) -> Iterator[None]:
        previous = getattr(_active, "packed", None)
        _active.packed = self
        try:
            yield
        finally:
            _active.packed = previous


def _key(tensor: torch.Tensor) -> tuple:
    return (tensor.data_ptr(), tensor.shape, tensor.stride())


def _onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in ONEDNN_DTYPES and weight.dtype == x.dtype


def inference_linears(
    x: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...] | None = None
) -> tuple[torch.Tensor, ...]:
    """Several linears of the same input (`inference_linear` each). While a `PackedWeights` is active,
    one GEMM on a packed concatenation of the weights, its output split into views (one call instead
    of three for Q, K, V: each call costs ~10 us of fixed overhead at decode sizes)."""
    biases = biases if biases is not None else (None,) * len(weights)
    packed = getattr(_active, "packed", None)
    if packed is None or not _onednn(x, weights[0]) or x.numel() <= GEMV_ROWS * x.shape[-1]:
        return tuple(inference_linear(x, w, b) for w, b in zip(weights, biases))
    weight, bias = packed.get_fused(weights, biases)
    out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return out.split([w.shape[0] for w in weights], dim=-1)


def inference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` without autograd: oneDNN's matmul for CPU tensors it supports (on the packed copy
    while a `PackedWeights` is active on this thread), else `F.linear`."""
    if _onednn(x, weight) and x.numel() > GEMV_ROWS * x.shape[-1]:
        packed = getattr(_active, "packed", None)
        if packed is not None:
            weight = packed.get(weight)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def active_ops(x: torch.Tensor):
    """The CPU kernels of the PackedWeights active on this thread, for fp32 CPU tensors, else None."""
    packed = getattr(_active, "packed", None)
    if packed is None or packed.ops is None or x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    return packed.ops


def inference_swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) without autograd (bias-free gate and up): with the CPU kernels
    active, one GEMM on the packed gate|up and one fused pass over its output (PyTorch's silu and
    product over the two strided halves took 1.94 ms at 512 x 1408, the fused pass 0.42 ms)."""
    ops = active_ops(x)
    if ops is not None and _onednn(x, gate) and x.numel() > GEMV_ROWS * x.shape[-1]:
        weight, _ = _active.packed.get_fused((gate, up), (None, None))
        return ops.silu_mul(torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], ""))
    g, u = inference_linears(x, (gate, up))
    return F.silu(g) * u


def inference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of fp32 rows without autograd: the CPU kernel where active, else `F.rms_norm`."""
    ops = active_ops(x)
    if ops is not None and x.is_contiguous() and weight.dtype == x.dtype:
        return ops.rms_norm(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)
