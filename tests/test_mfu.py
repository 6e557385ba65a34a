"""One FLOPs formula: the trainer's MFU and the simulator's agree on the same model and step time,
with the LM head's matmul counted whether or not it is tied to the input embedding."""

from dataclasses import replace

import pytest

from shiftlm.config import ModelConfig
from shiftlm.hardware import CATALOG, device_peak_flops
from shiftlm.presets import PRESETS
from shiftlm.sim.efficiency import FITTED
from shiftlm.sim.layout import Layout
from shiftlm.sim.train import simulate_step
from shiftlm.train.metrics import throughput

UNTIED = PRESETS["llama3-8b"]
TIED = replace(PRESETS["qwen2.5-7b"], tie_word_embeddings=True)
# head_dim set apart from hidden / heads (as Qwen3 and Gemma do)
WIDE_HEADS = ModelConfig(vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_layers=8,
                         num_heads=32, num_kv_heads=8, head_dim=128)  # fmt: skip


@pytest.mark.parametrize("model", [UNTIED, TIED, WIDE_HEADS], ids=["untied", "tied", "head_dim"])
def test_trainer_and_simulator_report_the_same_mfu_for_the_same_step_time(model):
    layout = Layout(dp=2, pp=2, tp=2, micro_batch=1, global_batch=16, seq_len=2048)
    simulated = simulate_step(model, layout, CATALOG["h100-sxm"], FITTED, "bf16")
    peak = device_peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    _, achieved, mfu = throughput(model, 2048, 16, simulated.step_time, layout.gpus, peak)
    assert mfu == pytest.approx(simulated.mfu, rel=1e-12)
    assert achieved / 1e12 == pytest.approx(simulated.tflops_per_gpu, rel=1e-12)


def test_a_tied_head_still_counts_its_matmul():
    untied = replace(TIED, tie_word_embeddings=False)
    assert TIED.num_params < untied.num_params  # one copy of the weights ...
    assert TIED.flops_per_token(2048) == untied.flops_per_token(2048)  # ... the same work


def test_attention_flops_follow_heads_times_head_dim_not_hidden():
    narrow = replace(WIDE_HEADS, head_dim=64)
    attention = WIDE_HEADS.flops_per_token(1024) - narrow.flops_per_token(1024)
    projections = 6 * WIDE_HEADS.num_layers * WIDE_HEADS.hidden_size * (2 * 32 + 2 * 8) * 64
    assert attention == pytest.approx(projections + 12 * 8 * 32 * 64 * 1024)
