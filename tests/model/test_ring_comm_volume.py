"""Bytes that ring attention moves per step equal the formula in docs/architecture.md ("Communication
volume", context parallelism), counted by `shiftlm.comm` over the cp group."""

from __future__ import annotations

import pytest
import torch

from shiftlm.comm import counters
from shiftlm.config import ModelConfig
from shiftlm.mesh import Mesh
from shiftlm.model import build_model
from shiftlm.model.ring_attention import sequence_indices
from shiftlm.parallel import ParallelConfig

FP32 = 4
BATCH, SEQ = 2, 24


def _step_counts(checkpoint: str, cp: int, sp: int, tp: int):
    config = ModelConfig.from_hf(checkpoint)
    mesh = Mesh(ParallelConfig(cp=cp, sp=sp, tp=tp))
    model = build_model(config, mesh, checkpoint=checkpoint)
    index = torch.from_numpy(sequence_indices(SEQ, cp, mesh.cp.rank, sp, mesh.sp.rank))
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))[:, index]
    counters.reset()
    logits = model(ids)
    forward = {key: value for key, value in counters.bytes.items() if key[1] == "cp"}
    forward_calls = {key: value for key, value in counters.calls.items() if key[1] == "cp"}
    logits.float().logsumexp(-1).sum().backward()
    total = {key: value for key, value in counters.bytes.items() if key[1] == "cp"}
    total_calls = {key: value for key, value in counters.calls.items() if key[1] == "cp"}
    return forward, forward_calls, total, total_calls


def expected_bytes(config: ModelConfig, cp: int, sp: int, tp: int, element: int = FP32):
    """docs/architecture.md: per rank and layer, t = B*S/cp tokens of the cp rank (after Ulysses),
    k = max(KV/(sp*tp), 1) KV heads, d head dim. Forward: (cp-1) K/V sends of 2*t*k*d elements;
    backward: the same K/V ring again plus cp fp32 dK/dV sends of 2*t*k*d. Receives mirror sends."""
    t, d = BATCH * SEQ // cp, config.head_dim
    k = max(config.num_kv_heads // (sp * tp), 1)
    kv_block = 2 * t * k * d
    layers = config.num_layers
    forward = layers * (cp - 1) * kv_block * element
    backward = layers * ((cp - 1) * kv_block * element + cp * kv_block * FP32)
    return forward, forward + backward


@pytest.mark.parametrize("cp,sp,tp", [(2, 1, 1), (4, 1, 1), (2, 2, 1), (2, 1, 2)], ids=str)
@pytest.mark.parametrize("family", ["llama", "llama-gqa"])
def test_ring_bytes_per_step_match_the_formula(ranks, tiny_checkpoints, family, cp, sp, tp):
    checkpoint = tiny_checkpoints[family]
    config = ModelConfig.from_hf(checkpoint)
    forward, total = expected_bytes(config, cp, sp, tp)
    layers = config.num_layers
    for fwd, fwd_calls, step, step_calls in ranks.run(cp * sp * tp, _step_counts, checkpoint, cp, sp, tp):
        assert fwd == {("send", "cp"): forward, ("recv", "cp"): forward}
        assert fwd_calls == {("send", "cp"): layers * (cp - 1), ("recv", "cp"): layers * (cp - 1)}
        assert step == {("send", "cp"): total, ("recv", "cp"): total}
        assert step_calls[("send", "cp")] == layers * (3 * cp - 2)  # (cp-1) + (cp-1) K/V + cp dK/dV
