"""`optim.fused`: the compiled AdamW update is the eager one, and a new learning rate is not a new graph."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from shiftlm.errors import ConfigError
from shiftlm.train.config import OptimSection, load_config
from shiftlm.train.optim import adamw_update


def _state(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    param, exp_avg = torch.randn(1000, generator=g), torch.zeros(1000)
    exp_avg_sq, mask = torch.zeros(1000), (torch.rand(1000, generator=g) > 0.2).float()
    return param, exp_avg, exp_avg_sq, mask


def test_fused_update_equals_eager_and_compiles_once():
    optim = OptimSection(weight_decay=0.1)
    eager, fused = _state(), _state()
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(1)
    for step in range(1, 7):
        grad = torch.randn(1000, generator=g)
        lr = 1e-3 * (1.0 + 0.37 * step)  # a new value every step, as the schedule's
        param, exp_avg, exp_avg_sq, mask = eager
        adamw_update(param, grad, exp_avg, exp_avg_sq, mask, step, lr, optim)
        param, exp_avg, exp_avg_sq, mask = fused
        adamw_update(param, grad, exp_avg, exp_avg_sq, mask, step, lr, optim, fused=True)
    for ours, theirs in zip(fused, eager):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    assert not torch.equal(eager[0], _state()[0])  # the parameters did move
    assert counters["stats"]["unique_graphs"] == 1


def test_fused_setting_is_checked():
    assert load_config(None, ["--optim.fused=true"]).optim.fused == "true"
    with pytest.raises(ConfigError, match="optim.fused = 'on'; use one of auto, true, false"):
        load_config(None, ["--optim.fused=on"])
