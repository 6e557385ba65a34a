"""Decode steps padded to captured shapes (serve/worker/decode_graphs.py) compute the eager step's
logits and write the same K/V: batches of 1 to 5 sequences padded to 1, 2, 4, 8 rows, contexts of 1
to 4 blocks padded to buckets of 1, 2, 4; padding rows touch the scratch block only. On the CPU the
padded step runs without graphs; on a GPU (`cuda` marker) the same steps replay captured graphs. Both
for the gather + SDPA attention and for FlexAttention reading the blocks in place (one context bucket)."""

from __future__ import annotations

import pytest
import torch

from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan
from shiftlm.tools.tiny import make_tiny_checkpoint

BLOCK, BLOCKS = 4, 64


def test_capture_sizes_are_vllms():
    from shiftlm.serve.worker.decode_graphs import capture_sizes, context_buckets

    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert (
        context_buckets(1) == [1]
        and context_buckets(8) == [1, 2, 4, 8]
        and context_buckets(10) == [1, 2, 4, 8, 10]
    )


def plans() -> list[StepPlan]:
    """Prefill 5 prompts (3-7 tokens), then decode batches of 5, 4, 3, 2, 1, 5, 5, 5 sequences."""
    prompts = [[(7 * i + j) % 200 + 3 for j in range(3 + i)] for i in range(5)]
    first = tuple(
        ScheduledChunk(i, tuple(p), 0, tuple(range(4 * i, 4 * i + 4)), True, row=i)
        for i, p in enumerate(prompts)
    )
    out, lengths = [StepPlan(0, Mode.TP, first)], [len(p) for p in prompts]
    for step, batch in enumerate((5, 4, 3, 2, 1, 5, 5, 5), start=1):
        out.append(
            StepPlan(
                step,
                Mode.TP,
                tuple(ScheduledChunk(i, (20 + step,), lengths[i], (), True, row=i) for i in range(batch)),
            )
        )
        for i in range(batch):
            lengths[i] += 1
    return out


def graphed_runner(model_dir, device: torch.device, dtype: torch.dtype, capture: bool, backend: str = "auto"):
    """A runner whose decode steps go through `DecodeGraphs` (max 8 sequences, 4 blocks each)."""
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.compiled_step import CompiledDecode
    from shiftlm.serve.worker.decode_graphs import DecodeGraphs
    from shiftlm.serve.worker.paged_attention import PagedKVCache
    from shiftlm.serve.worker.runner import ModelRunner

    mesh = Mesh(ParallelConfig(), device=device)
    runner = ModelRunner.load(
        model_dir,
        mesh,
        num_blocks=BLOCKS,
        block_size=BLOCK,
        dtype=dtype,
        gemv_rows=0,
        attention_backend=backend,
    )
    old = runner.cache
    layers, _, _, kv_heads, head_dim = old.storage.shape
    cache = PagedKVCache(layers, BLOCKS, BLOCK, kv_heads, head_dim, dtype, device, scratch=True)
    cache.kernel, cache.flex = old.kernel, old.flex
    runner.cache = runner.shift_model.cache = cache
    compiled = CompiledDecode(runner.shift_model.model, cache, max_seqs=BLOCKS, dynamic_batch=True)
    assert compiled.warm_up()
    runner.shift_model.compiled = compiled
    runner.shift_model.graphs = DecodeGraphs(compiled, max_seqs=8, max_blocks=4, capture=capture)
    runner.shift_model.graphs.capture_all()
    return runner


def check_padded_steps_equal_eager(
    tmp_path, device: torch.device, capture: bool, backend: str = "auto"
) -> None:
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    model_dir = make_tiny_checkpoint(tmp_path / "m", "llama-gqa")
    eager = ModelRunner.load(
        model_dir, Mesh(ParallelConfig(), device=device), num_blocks=BLOCKS, block_size=BLOCK
    )
    graphed = graphed_runner(model_dir, device, torch.float32, capture, backend)
    if backend == "flex":  # each sequence reads its own blocks whatever the table's width: one bucket
        assert graphed.shift_model.graphs.buckets == [4] and graphed.cache.flex
    for plan in plans():
        want, got = eager.execute(plan), graphed.execute(plan)
        error = float((got - want).abs().max() / want.abs().max())
        assert error <= 1e-5, (plan.step, len(plan.chunks), error)
    assert graphed.shift_model.graphs.steps == len(plans()) - 1  # every decode step went through it
    real = BLOCKS * BLOCK  # the sequences' slots; the scratch block's follow
    written = eager.cache.storage != 0
    assert torch.equal(graphed.cache.storage[:, :, :real] != 0, written)
    assert torch.allclose(
        graphed.cache.storage[:, :, :real][written], eager.cache.storage[written], rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("backend", ["auto", "flex"])
def test_padded_decode_steps_equal_the_eager_step_on_the_cpu(tmp_path, monkeypatch, backend):
    monkeypatch.delenv("SHIFTLM_COMPILE_DECODE", raising=False)
    check_padded_steps_equal_eager(tmp_path, torch.device("cpu"), capture=False, backend=backend)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["auto", "flex"])
def test_captured_cuda_graphs_equal_the_eager_step(tmp_path, monkeypatch, backend):
    monkeypatch.delenv("SHIFTLM_COMPILE_DECODE", raising=False)
    check_padded_steps_equal_eager(tmp_path, torch.device("cuda"), capture=True, backend=backend)


def test_no_graph_gathers_more_blocks_than_the_cache_holds(tmp_path, monkeypatch):
    """Shapes whose padded context would gather more blocks than the cache has get no graph (their
    steps run compiled without one), which bounds the reserved gather buffers by one layer's cache."""
    from shiftlm.serve.worker.decode_graphs import DecodeGraphs

    monkeypatch.delenv("SHIFTLM_COMPILE_DECODE", raising=False)
    model_dir = make_tiny_checkpoint(tmp_path / "m", "llama-gqa")
    runner = graphed_runner(model_dir, torch.device("cpu"), torch.float32, capture=False)
    graphs = DecodeGraphs(runner.shift_model.compiled, max_seqs=64, max_blocks=16, capture=False)
    assert (1, 16) in graphs.shapes and (4, 16) in graphs.shapes and (8, 8) in graphs.shapes
    assert all(size * blocks <= BLOCKS for size, blocks in graphs.shapes)
    assert (8, 16) not in graphs.shapes and (64, 1) in graphs.shapes
