"""Deferred weight gradients: the W pass of zero-bubble pipeline schedules (Qi et al. 2023, Sec. 2).

A linear layer's backward is two GEMMs: the input gradient dX = dY A, which the previous pipeline
stage waits for, and the weight gradient dA = dY^T X (plus db = sum dY), which nobody waits for.
Zero-bubble schedules run the first as I and the second later, as W, to fill bubbles. `deferrable_linear` is
`F.linear` with a backward that, while a `WeightGradStore` is deferring, returns only dX and queues
a closure computing dA and db; `store.flush(key)` runs the closures of that key and accumulates into
`.grad`. This is the zero-bubble implementation's `WeightGradStore` (put / flush / pop in
sail-sg/zero-bubble-pipeline-parallelism); PyTorch's `stage_backward_weight` instead re-enters the
autograd graph, which costs a second walk over every node.

    store = WeightGradStore()
    with store.deferring(key):          # I: every gradient except the queued GEMMs
        torch.autograd.grad(out, [x, *params], grad_out, allow_unused=True)
    store.flush(key)                    # W: dA = dY^T X for every deferrable linear, into .grad

Ask autograd for all parameters in the deferred pass, not only the input: the engine prunes nodes
that lead to no requested tensor, and the first linear of a stage leads only to its weight.
Parameters that no deferrable linear owns (norm weights, embeddings, a head computed with plain
`F.linear`) get their gradients during that pass, as usual. Without deferral the same formulas run at
once, so deferring changes when a weight gradient is computed, never its value (bit for bit).

The active store is a module global, not thread-local: on GPU the autograd engine runs backward
functions on its own device threads.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

_deferring: tuple[WeightGradStore, Hashable] | None = None


class WeightGradStore:
    """Weight-gradient closures queued by `linear` backwards, by key (e.g. (stage, micro-batch))."""

    def __init__(self) -> None:
        self._queues: dict[Hashable, list[Callable[[], None]]] = {}

    @contextmanager
    def deferring(self, key: Hashable) -> Iterator[None]:
        """Backwards run inside this block queue their weight-gradient GEMMs under `key`."""
        global _deferring
        if _deferring is not None:
            raise RuntimeError(f"weight gradients are already being deferred under {_deferring[1]!r}")
        _deferring = (self, key)
        try:
            yield
        finally:
            _deferring = None

    def put(self, key: Hashable, compute: Callable[[], None]) -> None:
        self._queues.setdefault(key, []).append(compute)

    def pending(self, key: Hashable) -> int:
        """How many weight-gradient closures wait under `key`."""
        return len(self._queues.get(key, ()))

    def flush(self, key: Hashable) -> None:
        """Run (and drop) the closures queued under `key`: the W of that key."""
        for compute in self._queues.pop(key, ()):
            compute()


def _weight_grads(
    x: torch.Tensor, grad_out: torch.Tensor, wants_weight: bool, wants_bias: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dA = dY^T X and db = sum dY over every row (batch and sequence flattened)."""
    rows = grad_out.reshape(-1, grad_out.shape[-1])
    grad_weight = rows.t() @ x.reshape(-1, x.shape[-1]) if wants_weight else None
    return grad_weight, rows.sum(0) if wants_bias else None


@torch.no_grad()
def accumulate_grad(param: torch.Tensor | None, grad: torch.Tensor | None) -> None:
    """param.grad += grad, out of place (a gradient autograd returned may alias another tensor);
    then the parameter's post-accumulate-grad hooks, as autograd's own accumulation runs them (ZeRO-2/3's
    sharded gradients, `train/grad_shards.py`, take each gradient as it lands, deferred ones too)."""
    if param is not None and grad is not None:
        param.grad = grad if param.grad is None else param.grad + grad
        for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
            hook(param)


@torch.no_grad()
def _accumulate_weight_grads(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    x: torch.Tensor,
    grad_out: torch.Tensor,
    wants_weight: bool,
    wants_bias: bool,
) -> None:
    """The W of one linear: weight.grad += dY^T X and bias.grad += sum dY, in place where a gradient
    exists (one addmm_, no temporary; `.grad` stays the tensor it was, e.g. a view of a trainer's
    flat buffer), else a fresh tensor of our own. Under bf16 autocast the GEMM runs in bf16 and its
    result is added to the fp32 gradient (what autocast's weight cast does in backward)."""
    rows = grad_out.reshape(-1, grad_out.shape[-1])
    if wants_weight:
        inputs = x.reshape(-1, x.shape[-1])
        if weight.grad is None:
            weight.grad = (rows.t() @ inputs).to(weight.dtype)
        elif weight.grad.dtype == rows.dtype:
            weight.grad.addmm_(rows.t(), inputs)
        else:
            weight.grad.add_(rows.t() @ inputs)
    if wants_bias and bias is not None:
        if bias.grad is None:
            bias.grad = rows.sum(0).to(bias.dtype)
        else:
            bias.grad.add_(rows.sum(0))


class _DeferrableLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        # the tensors to accumulate into: under activation checkpointing the saved `weight` comes back
        # as a detached alias, and a deferred gradient must land on the parameter itself
        ctx.params = (weight, bias)
        device = x.device.type
        if torch.is_autocast_enabled(device):  # as autocast runs F.linear: operands in its dtype, and
            dtype = torch.get_autocast_dtype(device)  # the bf16 copies are what backward multiplies
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        ctx.save_for_backward(x, weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias = ctx.saved_tensors
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        wants_weight = ctx.needs_input_grad[1]
        wants_bias = bias is not None and ctx.needs_input_grad[2]
        if _deferring is None:  # (autograd casts a bf16 gradient to its fp32 parameter's dtype)
            return grad_x, *_weight_grads(x, grad_out, wants_weight, wants_bias)
        if wants_weight or wants_bias:
            store, key = _deferring
            weight_param, bias_param = ctx.params

            def weight_pass() -> None:
                _accumulate_weight_grads(weight_param, bias_param, x, grad_out, wants_weight, wants_bias)

            store.put(key, weight_pass)
        return grad_x, None, None


def deferrable_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear` whose weight and bias gradients can be deferred by `WeightGradStore.deferring`
    (`model.ops.DEFERRABLE` runs every linear of a forward this way)."""
    return _DeferrableLinear.apply(x, weight, bias)


class Linear(nn.Linear):
    """`nn.Linear` built on `deferrable_linear` (for models outside the transformer, e.g. benches)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return deferrable_linear(x, self.weight, self.bias)
