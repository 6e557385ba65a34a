"""Decode steps padded to captured shapes (serve/worker/decode_graphs.py) compute the eager step's
logits and write the same K/V: batches of 1 to 5 sequences padded to 1, 2, 4, 8 rows, contexts of 1
to 4 blocks padded to buckets of 1, 2, 4; padding rows touch the scratch block only. On the CPU the
padded step runs without graphs; on a GPU (`cuda` marker) the same steps replay captured graphs. Both
for the gather + SDPA attention and for FlexAttention reading the blocks in place (one context bucket)."""

from __future__ import annotations

import pytest
import torch

from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan
from shiftlm.serve.worker.flex_decode import flex_refusal
from shiftlm.tools.tiny import make_tiny_checkpoint

BLOCK, BLOCKS = 4, 64
# FlexAttention on the CPU: only where shiftlm runs it (flex_refusal says why not)
cpu_flex = pytest.mark.skipif(flex_refusal("cpu") is not None, reason=str(flex_refusal("cpu")))


def test_capture_sizes_are_vllms():
    from shiftlm.serve.worker.decode_graphs import capture_sizes, context_buckets

    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    # --cuda-graph-sizes: one N, the pattern up to N; several, exactly those
    assert capture_sizes(64, (16,)) == [1, 2, 4, 8, 16] and capture_sizes(64, (20,)) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64, (64, 1)) == [1, 64] and capture_sizes(64, (3, 3, 5)) == [3, 5]
    assert (
        context_buckets(1) == [1]
        and context_buckets(8) == [1, 2, 4, 8]
        and context_buckets(10) == [1, 2, 4, 8, 10]
    )


def plans(mode: Mode = Mode.TP) -> list[StepPlan]:
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
                mode,
                tuple(ScheduledChunk(i, (20 + step,), lengths[i], (), True, row=i) for i in range(batch)),
            )
        )
        for i in range(batch):
            lengths[i] += 1
    return out


def graphed_runner(
    model_dir,
    device: torch.device,
    dtype: torch.dtype,
    capture: bool,
    backend: str = "auto",
    tp=1,
    sp=1,
    block: int = BLOCK,
    requested: tuple[int, ...] = (),
):
    """A runner whose decode steps go through `DecodeGraphs` (max 8 sequences, 4 blocks each;
    `requested`: --cuda-graph-sizes)."""
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.compiled_step import CompiledDecode
    from shiftlm.serve.worker.decode_graphs import DecodeGraphs
    from shiftlm.serve.worker.paged_attention import PagedKVCache
    from shiftlm.serve.worker.runner import ModelRunner

    mesh = Mesh(ParallelConfig(tp=tp, sp=sp), device=device)
    runner = ModelRunner.load(
        model_dir,
        mesh,
        num_blocks=BLOCKS,
        block_size=block,
        dtype=dtype,
        gemv_rows=0,
        attention_backend=backend,
    )
    old = runner.cache
    layers, _, _, kv_heads, head_dim = old.storage.shape
    cache = PagedKVCache(layers, BLOCKS, block, kv_heads, head_dim, dtype, device, scratch=True)
    cache.kernel, cache.flex = old.kernel, old.flex
    runner.cache = runner.shift_model.cache = cache
    shift = runner.shift_model
    compiled = CompiledDecode(shift.model, cache, BLOCKS, True, shift.full_tp, shift.head_view, shift.ulysses)
    assert compiled.warm_up()
    runner.shift_model.compiled = compiled
    runner.shift_model.graphs = DecodeGraphs(compiled, 8, 4, capture, requested)
    runner.shift_model.graphs.capture_all()
    return runner


def check_padded_steps_equal_eager(
    tmp_path,
    device: torch.device,
    capture: bool,
    backend: str = "auto",
    block: int = BLOCK,
    requested: tuple[int, ...] = (),
    heads: int = 8,
) -> None:
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    model_dir = make_tiny_checkpoint(tmp_path / "m", "llama-gqa", num_heads=heads)
    eager = ModelRunner.load(
        model_dir, Mesh(ParallelConfig(), device=device), num_blocks=BLOCKS, block_size=block
    )
    graphed = graphed_runner(
        model_dir, device, torch.float32, capture, backend, block=block, requested=requested
    )
    if backend == "flex":  # each sequence reads its own blocks whatever the table's width: one bucket
        assert graphed.shift_model.graphs.buckets == [4] and graphed.cache.flex
    for plan in plans():
        want, got = eager.execute(plan), graphed.execute(plan)
        error = float((got - want).abs().max() / want.abs().max())
        assert error <= 1e-5, (plan.step, len(plan.chunks), error)
    # every decode step went through it, where its batch has a size
    largest = graphed.shift_model.graphs.sizes[Mode.TP][-1]
    assert graphed.shift_model.graphs.steps == sum(len(p.chunks) <= largest for p in plans()[1:])
    real = BLOCKS * block  # the sequences' slots; the scratch block's follow
    written = eager.cache.storage != 0
    assert torch.equal(graphed.cache.storage[:, :, :real] != 0, written)
    assert torch.allclose(
        graphed.cache.storage[:, :, :real][written], eager.cache.storage[written], rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("backend", ["auto", pytest.param("flex", marks=cpu_flex)])
def test_padded_decode_steps_equal_the_eager_step_on_the_cpu(tmp_path, monkeypatch, backend):
    monkeypatch.delenv("SHIFTLM_COMPILE_DECODE", raising=False)
    check_padded_steps_equal_eager(tmp_path, torch.device("cpu"), capture=False, backend=backend)


@pytest.mark.parametrize("requested", [(1, 8), (2,)])
def test_cuda_graph_sizes_pad_to_the_sizes_asked_and_leave_larger_batches(tmp_path, monkeypatch, requested):
    """--cuda-graph-sizes 1 8: batches of 2-5 padded to 8 rows; --cuda-graph-sizes 2: sizes 1 and 2,
    and batches of 3-5 run the compiled step without a graph. Logits and cache equal eager's."""
    monkeypatch.delenv("SHIFTLM_COMPILE_DECODE", raising=False)
    check_padded_steps_equal_eager(tmp_path, torch.device("cpu"), capture=False, requested=requested)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["auto", "flex"])
def test_captured_cuda_graphs_equal_the_eager_step(tmp_path, monkeypatch, backend):
    monkeypatch.delenv("SHIFTLM_COMPILE_DECODE", raising=False)
    # flex on CUDA takes blocks and heads of 16 or more (Triton's tiles: flex_decode.flex_refusal)
    block, heads = (16, 4) if backend == "flex" else (BLOCK, 8)
    check_padded_steps_equal_eager(
        tmp_path, torch.device("cuda"), capture=True, backend=backend, block=block, heads=heads
    )


def test_no_graph_gathers_more_blocks_than_the_cache_holds(tmp_path, monkeypatch):
    """Shapes whose padded context would gather more blocks than the cache has get no graph (their
    steps run compiled without one), which bounds the reserved gather buffers by one layer's cache."""
    from shiftlm.serve.worker.decode_graphs import DecodeGraphs

    monkeypatch.delenv("SHIFTLM_COMPILE_DECODE", raising=False)
    model_dir = make_tiny_checkpoint(tmp_path / "m", "llama-gqa")
    runner = graphed_runner(model_dir, torch.device("cpu"), torch.float32, capture=False)
    graphs = DecodeGraphs(runner.shift_model.compiled, max_seqs=64, max_blocks=16, capture=False)
    shapes = {(size, blocks) for mode, size, blocks in graphs.shapes if mode is Mode.TP}
    assert (1, 16) in shapes and (4, 16) in shapes and (8, 8) in shapes
    assert all(size * blocks <= BLOCKS for size, blocks in shapes)
    assert (8, 16) not in shapes and (64, 1) in shapes


def padded_vs_eager_on_ranks(model_dir: str, tp: int, sp: int) -> dict:
    """Every rank: an eager runner and one whose decode steps go through `DecodeGraphs`, over the same
    plans in both modes; rank 0 returns the largest relative logit error."""
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    cpu = torch.device("cpu")
    eager = ModelRunner.load(
        model_dir, Mesh(ParallelConfig(tp=tp, sp=sp)), num_blocks=BLOCKS, block_size=BLOCK
    )
    graphed = graphed_runner(model_dir, cpu, torch.float32, False, tp=tp, sp=sp)
    worst, graphs = 0.0, graphed.shift_model.graphs
    for mode in Mode:
        for plan in plans(mode):
            want, got = eager.run_step(plan), graphed.run_step(plan)
            if want is not None:
                worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    real = BLOCKS * BLOCK
    same_cache = torch.allclose(graphed.cache.storage[:, :, :real], eager.cache.storage, rtol=1e-5, atol=1e-6)
    return dict(worst=worst, steps=graphs.steps, sizes=graphs.sizes, same_cache=same_cache)


@pytest.mark.parametrize("tp, sp", [(1, 2), (2, 1)])
def test_padded_decode_steps_of_both_modes_equal_eager_on_two_ranks(ranks, tmp_path, tp, sp):
    """Shift Parallelism on 2 gloo ranks: full-TP and SP x TP decodes, each through its mode's graphs
    (SP x TP's at batches of whole sp slices: 5 sequences run the graph of 8, 1 that of 2, each rank
    its slice of the padded batch), equal the eager step's logits (1e-5) and caches."""
    model_dir = make_tiny_checkpoint(tmp_path / "m", "llama-gqa")
    results = ranks.run(tp * sp, padded_vs_eager_on_ranks, str(model_dir), tp, sp)
    decodes = len(plans()) - 1
    for result in results:
        assert result["worst"] <= 1e-5 and result["same_cache"], result
        assert result["steps"] == 2 * decodes  # every decode step of both modes went through a graph
    assert results[0]["sizes"][Mode.SP_TP] == ([2, 4, 8] if sp == 2 else [1, 2, 4, 8])
