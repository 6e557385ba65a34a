"""How a forward runs its linears, norms and RoPE: chosen by the caller and passed down explicitly
(`ops=`), never read from a module global or from `torch.is_grad_enabled()`.

    PLAIN          autograd's own ops (`F.linear`, RMSNorm as transformers writes it): training without
                   a pipeline, a pipeline's B micro-batches, anything `torch.compile` traces (training's
                   compiled blocks, serving's compiled decode step), and plain inference (verify, parity)
    DEFERRABLE     linears whose weight gradients a `WeightGradStore` may defer (model/deferred.py): the
                   forwards a zero-bubble pipeline splits into I + W
    InferenceOps   serving's eager CPU step, no autograd: oneDNN GEMMs (on packed weight copies when
                   given a `PackedWeights`), Q|K|V and gate|up fused, the CPU kernels' RMSNorm, SwiGLU and
                   RoPE where the `PackedWeights` carries them (model/inference_linear.py)

Every layer's forward takes `ops` and hands it to its sublayers, so a recomputation in backward
(`torch.utils.checkpoint`) runs the ops its forward ran: they are an argument, not state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shiftlm.model.deferred import deferrable_linear
from shiftlm.model.inference_linear import (
    PackedWeights,
    cpu_kernels,
    inference_linear,
    inference_linears,
    inference_rms_norm,
    inference_swiglu,
)
from shiftlm.model.rope import apply_rope, apply_rope_qk


class Ops:
    """Autograd's own ops (`PLAIN`)."""

    name = "plain"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def linears(
        self,
        x: torch.Tensor,
        weights: tuple[torch.Tensor, ...],
        biases: tuple[torch.Tensor | None, ...] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """`linear` of one input with each weight (and bias); the outputs may be views of one tensor."""
        biases = biases if biases is not None else (None,) * len(weights)
        return tuple(self.linear(x, w, b) for w, b in zip(weights, biases))

    def swiglu(self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(linear(x, gate)) * linear(x, up) (bias-free)."""
        g, u = self.linears(x, (gate, up))
        return F.silu(g) * u

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Llama's RMSNorm as transformers computes it: in fp32, scaled in the input dtype."""
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(dtype)

    def rope_qk(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated apart (what dynamo traces: no pointer arithmetic)."""
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def __repr__(self) -> str:
        return f"<ops {self.name}>"


class DeferrableOps(Ops):
    """`DEFERRABLE`: every linear's weight gradient may wait for the pipeline's W pass."""

    name = "deferrable"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return deferrable_linear(x, weight, bias)


class InferenceOps(Ops):
    """Serving's eager step (no autograd): oneDNN GEMMs, on `packed`'s weight copies and with its CPU
    kernels when given (one per served model: the copies belong to its weights)."""

    name = "inference"

    def __init__(self, packed: PackedWeights | None = None):
        self.packed = packed

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return inference_linear(x, weight, bias, self.packed)

    def linears(self, x, weights, biases=None) -> tuple[torch.Tensor, ...]:
        """One GEMM on the packed concatenation where `packed` is given (outputs are views of it)."""
        return inference_linears(x, weights, biases, self.packed)

    def swiglu(self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return inference_swiglu(x, gate, up, self.packed)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype != torch.float32:  # F.rms_norm computes in the input dtype: transformers' formula
            return super().rms_norm(x, weight, eps)
        return inference_rms_norm(x, weight, eps, self.packed)

    def rope_qk(self, q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """In one pass over both where q and k are adjacent outputs of the fused Q|K|V GEMM."""
        return apply_rope_qk(q, k, cos, sin, cpu_kernels(q, self.packed))


PLAIN = Ops()
DEFERRABLE = DeferrableOps()
