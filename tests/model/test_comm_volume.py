"""Bytes per collective in one forward pass equal the formulas in docs/architecture.md."""

import pytest
import torch

from shiftlm.comm import counters
from shiftlm.config import ModelConfig
from shiftlm.mesh import Mesh
from shiftlm.model import build_model
from shiftlm.parallel import ParallelConfig

FP32 = 4
BATCH, SEQ = 2, 16


def _forward_counts(checkpoint, tp, sp, sequence_parallel):
    config = ModelConfig.from_hf(checkpoint)
    mesh = Mesh(ParallelConfig(tp=tp, sp=sp, sequence_parallel=sequence_parallel))
    model = build_model(config, mesh, checkpoint=checkpoint)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ // sp))
    counters.reset()
    with torch.no_grad():
        model(ids)
    return dict(counters.bytes), dict(counters.calls)


def expected_forward_bytes(config: ModelConfig, tp: int, sp: int, sequence_parallel: bool) -> dict:
    """The formulas of docs/architecture.md "Communication volume", per rank, forward only."""
    tokens = BATCH * SEQ // sp  # this rank's tokens (its Ulysses slice)
    h, d, layers = config.hidden_size, config.head_dim, config.num_layers
    blocks = tp * sp
    kv_per_block = max(config.num_kv_heads // blocks, 1)
    out: dict = {}
    if tp > 1 and not sequence_parallel:
        # embedding + 2 per layer (attention out, MLP out), each tokens x hidden
        out[("all_reduce", "tp")] = (1 + 2 * layers) * tokens * h * FP32
    if tp > 1 and sequence_parallel:
        # reduce-scatter of the embedding and of each row-parallel output (input: tokens x hidden);
        # all-gather before each column-parallel region and the head (input: tokens/tp x hidden)
        out[("reduce_scatter", "tp")] = (1 + 2 * layers) * tokens * h * FP32
        out[("all_gather", "tp")] = (2 * layers + 1) * tokens // tp * h * FP32
    if sp > 1:
        # in: q of my TP block plus, for each of the sp destinations, its KV heads; out: attention output
        qkv_in = tokens * (config.num_heads // tp + 2 * sp * kv_per_block) * d
        attn_out = tokens * (config.num_heads // tp) * d
        out[("all_to_all", "sp")] = layers * (qkv_in + attn_out) * FP32
    return out


@pytest.mark.parametrize(
    "tp,sp,sequence_parallel", [(2, 1, False), (1, 2, False), (2, 2, False), (2, 2, True), (4, 1, True)]
)
@pytest.mark.parametrize("family", ["llama", "llama-gqa"])
def test_forward_bytes_match_the_formulas(ranks, tiny_checkpoints, family, tp, sp, sequence_parallel):
    checkpoint = tiny_checkpoints[family]
    config = ModelConfig.from_hf(checkpoint)
    byte_counts, calls = ranks.run(tp * sp, _forward_counts, checkpoint, tp, sp, sequence_parallel)[0]
    assert byte_counts == expected_forward_bytes(config, tp, sp, sequence_parallel)
    if sp > 1:
        assert calls[("all_to_all", "sp")] == 2 * config.num_layers  # one in, one out per layer
    if tp > 1 and not sequence_parallel:
        assert calls[("all_reduce", "tp")] == 1 + 2 * config.num_layers


def test_mha_ulysses_moves_three_hidden_in_and_one_out(ranks, tiny_checkpoints):
    """Measured, with MHA and tp=1: the paper's 3 x tokens x hidden / SP in and 1 x out per layer."""
    checkpoint = tiny_checkpoints["llama"]
    config = ModelConfig.from_hf(checkpoint)
    sp = 2
    byte_counts, _ = ranks.run(sp, _forward_counts, checkpoint, 1, sp, False)[0]
    tokens = BATCH * SEQ // sp
    assert (
        byte_counts[("all_to_all", "sp")] == config.num_layers * (3 + 1) * tokens * config.hidden_size * FP32
    )
