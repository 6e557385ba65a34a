"""FlexAttention decode (`--attention-backend flex`, serve/worker/flex_decode.py): every query reads its
own sequence's blocks in place, cut at its position and sliding window, equal to SDPA over the
gathered context; a server step with it equals the gather + SDPA step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shiftlm.errors import ConfigError
from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan
from shiftlm.serve.worker import paged_attention
from shiftlm.serve.worker.flex_decode import check_flex, flex_decode, flex_plan
from shiftlm.tools.tiny import make_tiny_checkpoint

from .test_decode_graphs import cpu_flex, plans


def _reference(q, k_slots, v_slots, tables, positions, window, block):
    """Each sequence's context gathered by hand (positions lo..pos of its blocks), then SDPA."""
    out = []
    for s in range(q.shape[0]):
        pos = int(positions[s])
        slots = (tables[s][:, None] * block + torch.arange(block)).flatten()[: pos + 1]
        low = max(0, pos - window + 1) if window else 0
        k, v = (t[slots[low:]].permute(1, 0, 2)[None] for t in (k_slots, v_slots))
        out.append(F.scaled_dot_product_attention(q[s : s + 1, :, None], k, v, enable_gqa=True)[:, :, 0])
    return torch.cat(out)


@cpu_flex
@pytest.mark.parametrize(
    ("positions", "window", "dtype"),
    [
        ([5, 37, 100], 0, torch.float32),  # partial last blocks, many full blocks
        ([0, 15, 16, 127, 64], 0, torch.float32),  # one token; a block exactly full; the first slot of one
        ([0, 15, 16, 127, 64], 20, torch.float32),  # the window cuts the first block (and not at 15, 16)
        ([3, 90], 7, torch.bfloat16),
    ],
)
def test_flex_decode_reads_each_sequences_blocks_in_place(positions, window, dtype):
    torch.manual_seed(0)
    block, blocks, kv_heads, heads, dim, width = 16, 64, 2, 8, 32, 8
    k_slots, v_slots = (torch.randn(blocks * block, kv_heads, dim, dtype=dtype) for _ in range(2))
    seqs = len(positions)
    tables = torch.randperm(blocks)[: seqs * width].view(seqs, width)  # shuffled: no block order assumed
    positions = torch.tensor(positions)
    q = torch.randn(seqs, heads, dim, dtype=dtype)
    plan = flex_plan(tables.flatten(), positions, window, block, blocks * block)
    got = flex_decode(q, k_slots, v_slots, plan, block).float()
    want = _reference(q, k_slots, v_slots, tables, positions, window, block).float()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert float((got - want).abs().max() / want.abs().max()) <= tolerance


@cpu_flex
def test_a_cache_of_one_block_is_read_too():
    """The mask keeps room for two partial blocks even where the cache has fewer."""
    torch.manual_seed(0)
    k_slots, v_slots = (torch.randn(4, 1, 8) for _ in range(2))
    q, tables, positions = torch.randn(2, 2, 8), torch.zeros(2, 1, dtype=torch.long), torch.tensor([0, 3])
    got = flex_decode(q, k_slots, v_slots, flex_plan(tables.flatten(), positions, 0, 4, 4), 4)
    want = _reference(q, k_slots, v_slots, tables, positions, 0, 4)
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5


@cpu_flex
def test_any_query_count_runs_one_of_few_compiled_sizes(monkeypatch):
    """A mixed step's decode rows come in any count: each call is padded to vLLM's capture sizes
    (`padded_batch`), so 3-6 queries compile two functions (4 and 8 rows), not four, and every count
    still equals SDPA over its gathered context (padding rows dropped)."""
    from shiftlm.serve.worker import flex_decode as module

    sizes = [module.padded_batch(n) for n in (1, 2, 3, 5, 8, 9, 17, 24, 25)]
    assert sizes == [1, 2, 4, 8, 8, 16, 24, 24, 32]  # vLLM's: 1, 2, 4, 8, then multiples of 8
    monkeypatch.setattr(module, "_COMPILED", {})
    torch.manual_seed(0)
    block, blocks, width = 4, 48, 6
    k_slots, v_slots = (torch.randn(blocks * block, 2, 8) for _ in range(2))
    for seqs in (3, 4, 5, 6):
        # a sequence's blocks are distinct (as the cache allocates them); sequences may share some
        tables = torch.stack([torch.randperm(blocks)[:width] for _ in range(seqs)])
        positions = torch.randint(0, width * block, (seqs,))
        q = torch.randn(seqs, 4, 8)
        got = flex_decode(
            q, k_slots, v_slots, flex_plan(tables.flatten(), positions, 0, block, blocks * block), block
        )
        want = _reference(q, k_slots, v_slots, tables, positions, 0, block)
        assert got.shape == q.shape
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-5, seqs
    assert sorted(key[0][0] for key in module._COMPILED) == [4, 8]


def mixed_steps() -> list[StepPlan]:
    """After `plans()`: decode rows of sequences 0-3 beside a new prompt's 6-token prefill, then the
    next step's decode rows of all of them beside the rest of that prompt."""
    lengths = [3 + i for i in range(5)]
    for batch in (5, 4, 3, 2, 1, 5, 5, 5):
        for i in range(batch):
            lengths[i] += 1
    decodes = tuple(ScheduledChunk(i, (40,), lengths[i], (), True, row=i) for i in range(4))
    first = StepPlan(9, Mode.TP, (*decodes, ScheduledChunk(5, tuple(range(3, 9)), 0, (20, 21), True, row=5)))
    decodes = tuple(ScheduledChunk(i, (41,), lengths[i] + 1, (), True, row=i) for i in range(4))
    rest = ScheduledChunk(5, (9, 10, 11), 6, (22,), True, row=5, first_block=2)
    return [first, StepPlan(10, Mode.TP, (*decodes, rest))]


@cpu_flex
@pytest.mark.parametrize("family", ["llama-gqa", "mistral"])  # mistral: a sliding window of 6 tokens
def test_eager_steps_with_flex_equal_gather_and_sdpa(tmp_path, family, monkeypatch):
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    model_dir = make_tiny_checkpoint(tmp_path / "m", family)
    runners = {
        backend: ModelRunner.load(
            model_dir,
            Mesh(ParallelConfig(), device=torch.device("cpu")),
            num_blocks=64,
            block_size=4,
            compile_decode=False,
            attention_backend=backend,
        )
        for backend in ("sdpa", "flex")
    }
    assert runners["flex"].cache.flex and runners["flex"].cache.kernel is None
    for plan in plans():  # a prefill of 5 prompts, then decode batches of 1-5 up to 15 tokens
        want, got = runners["sdpa"].execute(plan), runners["flex"].execute(plan)
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-5, plan.step
    # mixed steps: their decode rows read the blocks in place with flex too (one call a layer)
    calls = []
    monkeypatch.setattr(
        paged_attention, "flex_decode", lambda *a: calls.append(a[0].shape) or flex_decode(*a)
    )
    for plan in mixed_steps():
        want, got = runners["sdpa"].execute(plan), runners["flex"].execute(plan)
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-5, plan.step
    layers = runners["flex"].model_config.num_layers
    assert calls == [torch.Size([4, *calls[0][1:]])] * (2 * layers), calls
    # the same K/V in the same slots (a later layer's differ in the last bits: its input went through
    # another attention kernel)
    flex, sdpa = runners["flex"].cache.storage, runners["sdpa"].cache.storage
    assert torch.equal(flex != 0, sdpa != 0) and torch.allclose(flex, sdpa, rtol=1e-5, atol=1e-6)


def test_flex_on_a_torch_with_a_broken_cpu_kernel_is_refused_in_one_line(tmp_path, monkeypatch):
    """torch 2.11's CPU FlexAttention kernel overruns the heap (the process aborts): refused with the
    fix named, by the runner before it builds the model; CUDA, and the CPU on a torch from 2.13, are not."""
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker import runner

    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with pytest.raises(ConfigError, match=r"needs torch>=2\.13 .*--attention-backend auto") as err:
        check_flex("cpu")
    assert "\n" not in str(err.value)
    monkeypatch.setattr(runner, "build_model", lambda *a, **k: pytest.fail("built the model first"))
    model_dir = make_tiny_checkpoint(tmp_path / "m", "llama-gqa")
    with pytest.raises(ConfigError, match="needs torch>=2.13"):
        runner.ModelRunner.load(
            model_dir, Mesh(ParallelConfig(), device="cpu"), 16, 4, attention_backend="flex"
        )
    check_flex(torch.device("cuda"))
    with pytest.raises(ConfigError, match=r"on CUDA needs --block-size >= 16 .*got 8"):
        check_flex(torch.device("cuda"), block_size=8)
    # a head size under tl.dot's 16 (the tiny models' 8): inductor's CUDA flex lowering refuses it
    check_flex(torch.device("cuda"), head_dim=16)
    with pytest.raises(
        ConfigError, match=r"on CUDA needs a head size >= 16 .*is 8: use --attention-backend auto"
    ):
        check_flex(torch.device("cuda"), head_dim=8)
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    check_flex("cpu")
