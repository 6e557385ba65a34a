"""Sizing the KV cache: from --num-blocks on the CPU, from GPU memory (--gpu-memory-utilization) on a
GPU; a cache that cannot hold one sequence is refused in one line naming the flags."""

from __future__ import annotations

import pytest
import torch

from shiftlm.config import ModelConfig
from shiftlm.errors import ConfigError
from shiftlm.parallel import ParallelConfig
from shiftlm.serve.engine.tokenizer import write_char_tokenizer
from shiftlm.serve.options import ServeOptions
from shiftlm.serve.worker.kv_memory import activation_bytes, blocks_for_memory, kv_bytes_per_block
from shiftlm.tools.tiny import make_tiny_checkpoint

GIB = 2**30
TINYLLAMA = ModelConfig(
    vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=22, num_heads=32, num_kv_heads=4,
    head_dim=64,
)  # fmt: skip


def test_block_bytes_and_the_memory_they_fit():
    # TinyLlama bf16: 2 (K, V) x 22 layers x 4 KV heads x 64 = 11,264 values per token, 22 KiB
    assert kv_bytes_per_block(TINYLLAMA, ParallelConfig(), 16, 2) == 11_264 * 2 * 16
    # sp x tp = 4 ranks share the 4 KV heads: one each
    assert kv_bytes_per_block(TINYLLAMA, ParallelConfig(sp=2, tp=2), 16, 2) == 11_264 * 2 * 16 // 4
    # 80 GiB at 0.9, 3 GiB in use (context + weights), 1 GiB of activations: 68 GiB of blocks
    per_block = kv_bytes_per_block(TINYLLAMA, ParallelConfig(), 16, 2)
    blocks = blocks_for_memory(77 * GIB, 80 * GIB, 0.9, GIB, per_block)
    assert blocks == int((0.9 * 80 - 3 - 1) * GIB // per_block)
    assert blocks_for_memory(GIB, 80 * GIB, 0.9, GIB, per_block) == 0  # nothing left: 0, never negative
    # the step's working set grows with the step's tokens
    small, large = (activation_bytes(TINYLLAMA, ParallelConfig(), n, 64, 2) for n in (256, 8192))
    assert 0 < small < large


def _checkpoint(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path / "m", "llama-gqa")
    write_char_tokenizer(model_dir, vocab_size=256)
    return model_dir


def test_the_cpu_default_and_the_startup_words(tmp_path):
    model_dir = _checkpoint(tmp_path)
    setup = ServeOptions(str(model_dir), max_model_len=128).resolve()
    assert setup.runner.num_blocks == 256 and setup.scheduler.num_blocks == 256  # 4,096 tokens of 16
    assert setup.describe_kv_cache() == (
        "KV cache 4,096 tokens per rank (256 blocks of 16): 32.0x requests of max_model_len=128 at once"
    )
    with pytest.raises(ConfigError, match="--max-model-len 128 must be in \\[2, 64\\].*raise --num-blocks"):
        ServeOptions(str(model_dir), max_model_len=128, num_blocks=4).resolve()
    with pytest.raises(ConfigError, match="--gpu-memory-utilization 1.5 must be in \\(0, 1\\]"):
        ServeOptions(str(model_dir), gpu_memory_utilization=1.5).resolve()


def test_a_gpu_cache_too_small_for_one_sequence_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    """On a (faked) 8 GiB GPU with 7.9 GiB in use, 0.9 of it leaves no room: one line, the flags named."""
    import shiftlm.mesh as mesh

    model_dir = _checkpoint(tmp_path)
    monkeypatch.setattr(mesh, "choose_device", lambda *a, **k: (torch.device("cuda", 0), "nccl"))
    monkeypatch.setattr(mesh, "check_dtype", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GIB // 10, 8 * GIB))
    with pytest.raises(
        ConfigError, match="KV cache holds 0 tokens per rank.*--gpu-memory-utilization 0.9 of 8.0 GiB"
    ):
        ServeOptions(str(model_dir)).resolve()
    # with room, the count is left to the ranks (sized once the weights are in memory)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (7 * GIB, 8 * GIB))
    setup = ServeOptions(str(model_dir)).resolve()
    assert setup.runner.num_blocks is None and setup.scheduler is None
    assert setup.with_kv_blocks(1000).scheduler.num_blocks == 1000


@pytest.mark.parametrize(
    "option,value,words",
    [
        ("max_num_seqs", 0, "--max-num-seqs 0 must be >= 1"),
        ("max_tokens_per_step", 0, "--max-num-batched-tokens 0 must be >= 1"),
        ("block_size", 0, "--block-size 0 must be >= 1"),
        ("max_pending", -1, "--max-pending -1 must be >= 1"),
        ("shift_threshold", -3, "--shift-threshold -3 must be a token count >= 0 or auto"),
        ("port", 99999, "--port 99999 must be in [0, 65535]"),
        ("log_interval", -1.0, "--log-interval -1.0 must be >= 0"),
        ("shutdown_timeout", -1.0, "--shutdown-timeout -1.0 must be >= 0"),
        ("timeout_keep_alive", 0.0, "--timeout-keep-alive 0.0 must be > 0"),
        ("cuda_graph_sizes", (1, 128), "--cuda-graph-sizes 128 is outside 1..--max-num-seqs 64"),
        ("cuda_graph_sizes", (0,), "--cuda-graph-sizes 0 is outside 1..--max-num-seqs 64"),
    ],
)
def test_every_numeric_serve_option_is_checked_before_the_checkpoint(option, value, words):
    """A zero or negative limit was accepted: with `--max-num-seqs 0` or `--max-num-batched-tokens 0`
    a server started and every request waited for ever (`LLM.generate` never returned);
    `--block-size 0` failed later, in the scheduler's own ValueError.
    Each is one line naming the flag and its range, raised before the checkpoint is even read (the
    model path here does not exist) and for `LLM(...)`'s keywords alike (same options)."""
    with pytest.raises(ConfigError) as refused:
        ServeOptions("/no/such/model", **{option: value}).resolve()
    assert str(refused.value) == words or str(refused.value).startswith(words), str(refused.value)
