"""A calibrated CUDA profile's attention and host fields reach the simulator (issue 31, item 4):
`shiftlm calibrate` on CUDA writes causal attention forward / backward FLOP/s by sequence length and
the host time per layer of an eager and a compiled step (`sim/calibrate_device.py`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shiftlm.hardware import CATALOG
from shiftlm.presets import PRESETS
from shiftlm.sim.costs import (
    LAYER_OPS_BACKWARD,
    LAYER_OPS_FORWARD,
    Shard,
    forward_ops,
    kernels_time,
    layer_pass_costs,
)
from shiftlm.sim.efficiency import measured

MODEL = PRESETS["llama3-8b"]


def _profile(forward: float, backward: float):
    extra = {"attention_fwd_1024": forward / 4, "attention_bwd_1024": backward / 4}
    extra |= {"attention_fwd_4096": forward, "attention_bwd_4096": backward, "op_overhead": 5e-6}
    return replace(CATALOG["h100-sxm"], extra=extra)


def test_flash_attention_runs_at_the_measured_rate_of_the_nearest_length():
    hardware, efficiency = _profile(300e12, 200e12), measured({"op_overhead": 5e-6})
    for seq, rate in ((4096, 300e12), (3000, 300e12), (1200, 75e12)):
        (flash,) = [op for op in forward_ops(MODEL, 1, seq, seq, Shard()) if op.name == "flash_attention"]
        assert kernels_time([flash], hardware, efficiency, "bf16") == pytest.approx(flash.flops / rate + 5e-6)


def test_the_backward_takes_the_measured_backward_rate():
    """Halving the measured backward rate adds the backward's 2.5x forward FLOPs at that rate once
    more to the input-gradient pass; the forward does not move."""
    efficiency = measured({"op_overhead": 5e-6})
    (flash,) = [op for op in forward_ops(MODEL, 1, 4096, 4096, Shard()) if op.name == "flash_attention"]
    fast, slow = (
        layer_pass_costs(
            MODEL, 1, 4096, Shard(), "selective", _profile(300e12, rate), efficiency, "bf16", 0.0
        )
        for rate in (200e12, 100e12)
    )
    assert slow.forward == fast.forward
    assert slow.backward_input - fast.backward_input == pytest.approx(2.5 * flash.flops / 200e12, rel=1e-6)


def test_the_measured_host_time_per_layer_of_the_mode_is_the_host_op_of_a_profile():
    per_layer = 1.2e-3
    ops = LAYER_OPS_FORWARD + LAYER_OPS_BACKWARD
    both = {"step_overhead_eager": per_layer, "step_overhead_compiled": per_layer / 3}
    assert measured(both, compiled=False).host_op == pytest.approx(per_layer / ops)
    assert measured(both, compiled=True).host_op == pytest.approx(per_layer / 3 / ops)
    assert measured({"op_overhead": 5e-6}).host_op == 0.0  # a CPU profile from calibrate.py: as before
