"""Linear layers without autograd (serving): oneDNN's matmul on CPU, optionally on prepacked weights.

On this machine's AVX-512 cores oneDNN runs the fp32 GEMMs of a hidden-512 model ~2.3x faster than
`F.linear` (MKL) at 32-512 rows and as fast at 1 row, on the weight as it is (views included). A copy
of the weight in oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`) makes a whole
decode step ~25% faster at 1 sequence and ~15% at 32 (docs/serving.md "Decode step"); it costs one
more copy of each weight a mode uses, so only callers that ask for it get it (`PackedWeights`).
Everything else falls back to `F.linear`: other devices, dtypes oneDNN lacks here. So do inputs of at
most `GEMV_ROWS` rows (a 1-sequence decode step) where MKL's GEMV is the faster one: on an Intel Xeon
(AVX-512) it skips oneDNN's ~11 us of fixed cost per call (hidden-512 model's 5 GEMMs a layer, 1 row,
hot: 845 vs 987 us; from 4 rows on oneDNN wins, 998 vs 1626), while on an AMD EPYC MKL's GEMV takes
about twice oneDNN's packed one (a whole 1-sequence decode step 4.76 vs 2.75 ms, `python
bench/serve_kernels.py`). Which one a
`PackedWeights` uses for small inputs is measured on the model's own weights when serving starts
(`PackedWeights.choose_small_rows`), not assumed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def _onednn_dtypes() -> frozenset[torch.dtype]:
    if not torch.backends.mkldnn.is_available():
        return frozenset()
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return frozenset({torch.float32, torch.bfloat16} if bf16 else {torch.float32})


ONEDNN_DTYPES = _onednn_dtypes()
log = logging.getLogger(__name__)
GEMV_ROWS = 2  # inputs of at most this many rows may run MKL's F.linear on the weights as they are
PACK_ROWS = 32  # the row count oneDNN tunes a packed layout for; measured as good from 1 to 512 rows


class PackedWeights:
    """oneDNN-layout copies of the weights a forward's linears use, made on first use (the forward is
    handed them explicitly: `model.ops.InferenceOps(packed)`).

    Keyed by the weight's storage address, shape and strides, so a view (full-TP's head slices) gets a
    copy of its own. The weights must not change while the copies are in use (serving's are frozen)."""

    def __init__(self, ops=None, gemv_rows: int = GEMV_ROWS) -> None:
        self._copies: dict[tuple, torch.Tensor] = {}
        # the CPU kernels (kernels/cpu.py) the forward may use for its fused RMSNorm, SwiGLU and
        # RoPE; None: PyTorch's ops
        self.ops = ops
        # inputs of at most this many rows run MKL's `F.linear` on the weights as they are (0: none);
        # `choose_small_rows` measures it
        self.gemv_rows = gemv_rows

    def choose_small_rows(
        self, layers: Sequence[Sequence[Sequence[torch.Tensor]]], reps: int = 15, budget_s: float = 2.0
    ) -> int:
        """Measure, on the model's own weights, whether MKL's GEMV (`F.linear` on each weight) or oneDNN
        on the packed (fused) copies is faster for inputs of 1 to `GEMV_ROWS` rows, and keep MKL for the
        row counts up to the first where it loses. `layers`: per layer, the weight groups of one input
        each (Q|K|V, O, gate|up, down). The two run alternately, `reps` times (fewer
        past `budget_s` seconds: a big model), best of each compared; one log line. Returns (and sets) `gemv_rows`; the
        packed copies it times are its own and dropped after."""
        groups = [tuple(group) for layer in layers for group in layer]
        if not groups or not all(_onednn(g[0], g[0]) for g in groups):
            return self.gemv_rows
        best: dict[tuple[int, str], float] = {}
        probe = PackedWeights()  # copies for the probe only: the forward may use other views
        with torch.no_grad():
            for rows in range(1, GEMV_ROWS + 1):
                inputs = [
                    torch.randn(rows, g[0].shape[1], dtype=g[0].dtype, device=g[0].device) for g in groups
                ]
                fused = [probe.get_fused(g, (None,) * len(g))[0] for g in groups]
                runs = {
                    "mkl": lambda inputs=inputs: [F.linear(x, w) for x, g in zip(inputs, groups) for w in g],
                    "onednn": lambda inputs=inputs, fused=fused: [
                        _onednn_linear(x, w) for x, w in zip(inputs, fused)
                    ],
                }
                deadline = time.perf_counter() + budget_s / GEMV_ROWS
                for rep in range(reps + 2):  # the first two of each warm up
                    if rep > 2 and time.perf_counter() > deadline:
                        break
                    for name, run in runs.items():
                        start = time.perf_counter()
                        run()
                        took = time.perf_counter() - start
                        best[rows, name] = min(best.get((rows, name), float("inf")), took)
        gemv_rows = 0
        while gemv_rows < GEMV_ROWS and best[gemv_rows + 1, "mkl"] < best[gemv_rows + 1, "onednn"]:
            gemv_rows += 1
        self.gemv_rows = gemv_rows
        log.info(
            "small-batch linears: %s (1 row: MKL %.0f us, oneDNN packed %.0f us over the model's weights)",
            f"MKL up to {gemv_rows} row(s)" if gemv_rows else "oneDNN packed at every size",
            1e6 * best[1, "mkl"],
            1e6 * best[1, "onednn"],
        )
        return gemv_rows

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


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _key(tensor: torch.Tensor) -> tuple:
    return (tensor.data_ptr(), tensor.shape, tensor.stride())


def _onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in ONEDNN_DTYPES and weight.dtype == x.dtype


def inference_linears(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    biases: tuple[torch.Tensor | None, ...] | None = None,
    packed: PackedWeights | None = None,
) -> tuple[torch.Tensor, ...]:
    """Several linears of the same input (`inference_linear` each). With `packed`, one GEMM on a packed
    concatenation of the weights, its output split into views (one call instead of three for Q, K, V:
    each call costs ~10 us of fixed overhead at decode sizes)."""
    biases = biases if biases is not None else (None,) * len(weights)
    if packed is None or not _onednn(x, weights[0]) or x.numel() <= packed.gemv_rows * x.shape[-1]:
        return tuple(inference_linear(x, w, b, packed) for w, b in zip(weights, biases))
    weight, bias = packed.get_fused(weights, biases)
    out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return out.split([w.shape[0] for w in weights], dim=-1)


def inference_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: PackedWeights | None = None,
) -> torch.Tensor:
    """`F.linear` without autograd: oneDNN's matmul for CPU tensors it supports (on the copy in
    `packed` when given), else `F.linear`."""
    if _onednn(x, weight):
        if x.numel() > (GEMV_ROWS if packed is None else packed.gemv_rows) * x.shape[-1]:
            if packed is not None:
                weight = packed.get(weight)
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def cpu_kernels(x: torch.Tensor, packed: PackedWeights | None):
    """The CPU kernels `packed` carries, for fp32 CPU tensors, else None."""
    if packed is None or packed.ops is None or x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    return packed.ops


def inference_swiglu(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, packed: PackedWeights | None = None
) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) without autograd (bias-free gate and up): with the CPU kernels,
    one GEMM on the packed gate|up and one fused pass over its output (PyTorch's silu and product
    over the two strided halves took 1.94 ms at 512 x 1408, the fused pass 0.42 ms)."""
    ops = cpu_kernels(x, packed)
    if ops is not None and _onednn(x, gate) and x.numel() > packed.gemv_rows * x.shape[-1]:
        weight, _ = packed.get_fused((gate, up), (None, None))
        return ops.silu_mul(torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], ""))
    g, u = inference_linears(x, (gate, up), packed=packed)
    return F.silu(g) * u


def inference_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, packed: PackedWeights | None = None
) -> torch.Tensor:
    """RMSNorm of fp32 rows without autograd: the CPU kernel where `packed` carries it, else
    `F.rms_norm`."""
    ops = cpu_kernels(x, packed)
    if ops is not None and x.is_contiguous() and weight.dtype == x.dtype:
        return ops.rms_norm(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)
