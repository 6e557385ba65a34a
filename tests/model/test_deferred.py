"""Deferred weight gradients: I computes none of the deferred ones, W makes them bit-identical."""

from __future__ import annotations

import copy

import pytest
import torch

from shiftlm.config import ModelConfig
from shiftlm.model import build_model
from shiftlm.model.deferred import Linear, WeightGradStore, deferrable_linear
from shiftlm.model.layers import RMSNorm
from shiftlm.model.ops import DEFERRABLE


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(Linear(6, 8), torch.nn.Tanh(), RMSNorm(8, 1e-6), Linear(8, 5, bias=False))


def _plain_grads(module: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    reference = copy.deepcopy(module)
    reference(x).square().sum().backward()
    return {name: p.grad for name, p in reference.named_parameters()}


def _deferred_backward(module: torch.nn.Module, x: torch.Tensor, store: WeightGradStore) -> None:
    out = module(x).square().sum()
    with store.deferring("mb0"):
        grads = torch.autograd.grad(out, list(module.parameters()), allow_unused=True)
    for param, grad in zip(module.parameters(), grads):
        param.grad = grad


def test_input_pass_leaves_linear_weight_grads_to_the_queue():
    module, store = _mlp(), WeightGradStore()
    x = torch.randn(3, 4, 6)
    _deferred_backward(module, x, store)
    deferred = {name for name, p in module.named_parameters() if p.grad is None}
    assert deferred == {"0.weight", "0.bias", "3.weight"}
    assert module[2].weight.grad is not None  # the norm weight belongs to no linear: computed in I
    assert store.pending("mb0") == 2


def test_weight_pass_gives_exactly_the_plain_backward_grads():
    module, store = _mlp(), WeightGradStore()
    x = torch.randn(3, 4, 6)
    want = _plain_grads(module, x)
    _deferred_backward(module, x, store)
    store.flush("mb0")
    assert store.pending("mb0") == 0
    for name, param in module.named_parameters():
        assert torch.equal(param.grad, want[name]), name


def test_deferrable_linear_matches_torch_linear():
    x = torch.randn(2, 3, 6, requires_grad=True)
    weight, bias = torch.randn(4, 6, requires_grad=True), torch.randn(4, requires_grad=True)
    ours = torch.autograd.grad(deferrable_linear(x, weight, bias).sin().sum(), [x, weight, bias])
    torch_ = torch.autograd.grad(torch.nn.functional.linear(x, weight, bias).sin().sum(), [x, weight, bias])
    for a, b in zip(ours, torch_):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("defer", [False, True])
def test_bf16_autocast_gives_fp32_grads_as_autocast_linear_does(defer):
    """Training's GPU precision (bf16 autocast over fp32 master weights), on the CPU's autocast: the
    deferrable linear multiplies bf16 copies and lands fp32 gradients on the fp32 parameters, as
    `F.linear` under autocast does, whether the weight gradient runs at once or from the store. Two
    micro-batches, so the second accumulates into the first's fp32 gradients."""
    module, store = _mlp(), WeightGradStore()
    x = torch.randn(3, 4, 6)
    reference = copy.deepcopy(module)
    for layer in reference:  # autograd's own linears
        if isinstance(layer, Linear):
            layer.__class__ = torch.nn.Linear
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = reference(x).float().square().sum()
        out.backward()
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x).float().square().sum()
        if not defer:
            out.backward()
            continue
        with store.deferring("mb"):
            grads = torch.autograd.grad(out, list(module.parameters()), allow_unused=True)
        for param, grad in zip(module.parameters(), grads):
            if grad is not None:
                param.grad = grad if param.grad is None else param.grad + grad
        store.flush("mb")
    for (name, ours), theirs in zip(module.named_parameters(), reference.parameters()):
        assert ours.grad.dtype == torch.float32, name
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=2e-2, atol=2e-2, msg=name)


def test_transformer_weight_pass_gives_exactly_the_plain_backward_grads():
    config = ModelConfig(attention_bias=True, tie_word_embeddings=True)
    model = build_model(config, seed=3)
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    targets = ids.roll(-1, dims=1)
    reference = copy.deepcopy(model)
    reference.loss(reference(ids), targets).mean().backward()

    store = WeightGradStore()
    loss = model.loss(model(ids, ops=DEFERRABLE), targets).mean()
    with store.deferring(0):
        grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    for param, grad in zip(model.parameters(), grads):
        param.grad = grad
    # q/k/v/o and gate/up/down of every layer (weights and q/k/v biases), and the LM head, wait for W
    assert store.pending(0) == 7 * config.num_layers + 1
    assert all(p.grad is None for n, p in model.named_parameters() if n.endswith("proj.weight"))
    store.flush(0)
    for (name, param), want in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(param.grad, want.grad), name


def test_deferring_twice_at_once_is_refused():
    store = WeightGradStore()
    with store.deferring(0), pytest.raises(RuntimeError, match="already being deferred"):
        with store.deferring(1):
            pass
    with store.deferring(2):  # the refused block left no deferral behind
        pass
