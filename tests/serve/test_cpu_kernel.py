"""The CPU kernels (kernels/csrc/cpu_kernels.cpp): paged attention of decode rows straight from the cache
blocks must equal the gather + SDPA path it replaces, the fused RMSNorm and SwiGLU must equal PyTorch's
ops, and a server must run with or without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shiftlm.errors import ConfigError
from shiftlm.kernels import cpu as cpu_kernels
from shiftlm.serve.worker.paged_attention import AttentionGroup, FlatBatch, PagedAttention, PagedKVCache

kernel = cpu_kernels.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C++ compiler here: the kernel cannot be built")


def decode_step(
    kv_heads: int, heads: int, head_dim: int, contexts: list[int], window: int, dtype, block: int = 4
):
    """A cache with random K/V, one decode row per sequence at position contexts[s] - 1, blocks of
    each sequence scattered (not in order); returns (cache, batch, q [S, Hq, D], k/v of the new rows)."""
    torch.manual_seed(len(contexts) * 31 + head_dim + window)
    seqs, longest = len(contexts), max(contexts)
    per_seq = -(-longest // block)
    cache = PagedKVCache(1, seqs * per_seq + 3, block, kv_heads, head_dim, dtype)
    cache.storage.normal_()
    tables = torch.randperm(seqs * per_seq + 3)[: seqs * per_seq].view(seqs, per_seq)
    positions = torch.tensor(contexts) - 1
    slots = tables[torch.arange(seqs), positions // block] * block + positions % block
    key_pos = torch.arange(per_seq * block)
    distance = positions.unsqueeze(1) - key_pos
    mask = distance >= 0
    if window:
        mask &= distance < window
    group = AttentionGroup(
        torch.arange(seqs).view(seqs, 1),
        None,
        mask.view(seqs, 1, 1, -1),
        tables.flatten(),
        query_pos=positions.view(seqs, 1),
        window=window,
    )
    ids = torch.zeros(seqs, dtype=torch.long)
    batch = FlatBatch(ids, positions, slots, (group,), torch.arange(seqs), seqs)
    q = torch.randn(1, seqs, heads, head_dim, dtype=dtype)
    k, v = (torch.randn(1, seqs, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    return cache, batch, q, k, v


@needs_kernel
@pytest.mark.parametrize(
    ("kv_heads", "heads", "head_dim", "contexts", "window"),
    [
        (2, 8, 64, [1, 4, 5, 17, 160], 0),  # GQA, contexts inside, at and across block edges
        (2, 8, 64, [1100, 3], 0),  # longer than the 512 keys one sequence's rows are touched at a time
        (4, 4, 128, [3, 9, 33], 0),  # MHA, head size 128
        (1, 6, 32, [30, 7, 12], 5),  # one KV head, a sliding window cutting mid-block, generic size
    ],
)
@pytest.mark.parametrize("threads", ["one", "more than sequences"])
def test_kernel_equals_gather_and_sdpa(kv_heads, heads, head_dim, contexts, window, threads):
    """Both decode kernels: one sequence per work item (as many sequences as threads or more) and one
    (sequence, KV head) per item (fewer sequences than threads)."""
    outputs = {}
    before = torch.get_num_threads()
    torch.set_num_threads(1 if threads == "one" else len(contexts) + 1)
    try:
        for name, module in (("sdpa", None), ("kernel", kernel)):
            cache, batch, q, k, v = decode_step(kv_heads, heads, head_dim, contexts, window, torch.float32)
            cache.kernel = module
            outputs[name] = PagedAttention(cache, batch)(0, q, k, v)
    finally:
        torch.set_num_threads(before)
    scale = outputs["sdpa"].abs().max()
    assert (outputs["kernel"] - outputs["sdpa"]).abs().max() <= 1e-5 * scale


@needs_kernel
def test_kernel_in_bf16_matches_fp32_attention():
    cache, batch, q, k, v = decode_step(2, 8, 64, [6, 21, 40], 0, torch.bfloat16)
    cache.kernel = kernel
    out = PagedAttention(cache, batch)(0, q, k, v).float()
    ref_cache = PagedKVCache(1, cache.num_blocks, cache.block_size, 2, 64, torch.float32)
    ref_cache.storage.copy_(cache.storage.float())
    reference = PagedAttention(ref_cache, batch)(0, q.float(), k.float(), v.float())
    assert (out - reference).abs().max() <= 2e-2 * reference.abs().max()  # bf16's 8 bits of mantissa


@needs_kernel
def test_kernel_path_is_what_a_runner_uses_by_default(tmp_path, monkeypatch):
    """ModelRunner picks the kernel on CPU (auto) and not with sdpa; greedy tokens are the same."""
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan
    from shiftlm.serve.worker.runner import ModelRunner
    from shiftlm.tools.tiny import make_tiny_checkpoint

    monkeypatch.delenv("SHIFTLM_ATTENTION_BACKEND", raising=False)
    model_dir = make_tiny_checkpoint(tmp_path / "m", "llama-gqa")
    tokens = {}
    for backend in ("auto", "sdpa"):
        runner = ModelRunner.load(model_dir, Mesh(ParallelConfig()), 16, 4, attention_backend=backend)
        assert (runner.cache.kernel is not None) == (backend == "auto")
        seq = [5, 17, 33, 2, 9]
        plan = StepPlan(0, Mode.TP, (ScheduledChunk(0, tuple(seq), 0, (0, 1), True, row=0),))
        out = []
        for step in range(6):
            token = int(runner.run_step(plan)[0].argmax())
            out.append(token)
            pos = len(seq) + step
            new_block = (pos // 4,) if pos % 4 == 0 else ()
            plan = StepPlan(step + 1, Mode.TP, (ScheduledChunk(0, (token,), pos, new_block, True, row=0),))
        tokens[backend] = out
    assert tokens["auto"] == tokens["sdpa"]


def test_unknown_attention_backend_is_refused(tmp_path):
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner
    from shiftlm.tools.tiny import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(tmp_path / "m", "llama-gqa")
    with pytest.raises(ConfigError, match="attention backend 'flash'"):
        ModelRunner.load(model_dir, Mesh(ParallelConfig()), 16, 4, attention_backend="flash")


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 7, 512), (3, 64), (1, 1, 96), (0, 512)])
def test_fused_rms_norm_equals_torch(shape):
    torch.manual_seed(sum(shape))
    x = torch.randn(shape) * 3
    weight = torch.randn(shape[-1])
    expected = F.rms_norm(x, weight.shape, weight, 1e-5)
    torch.testing.assert_close(kernel.rms_norm(x, weight, 1e-5), expected, rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 5, 2 * 1408), (2, 2 * 37), (0, 64)])
def test_fused_silu_mul_equals_torch(shape):
    torch.manual_seed(sum(shape))
    gate_up = torch.randn(shape) * 4
    if gate_up.numel():
        gate_up.view(-1)[:4] = torch.tensor([-100.0, 100.0, -30.0, 0.0])  # saturated silu: no inf/NaN
    gate, up = gate_up.chunk(2, dim=-1)
    out = kernel.silu_mul(gate_up)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 33, 512])
@pytest.mark.parametrize("batched", [False, True])
def test_fused_rope_equals_apply_rope(tokens, batched):
    """RoPE of the fused Q|K view (k's heads right after q's, rows strided by the QKV GEMM's width) and
    of separate q and k, by the kernel inside the serving forward, equals `apply_rope`."""
    from shiftlm.model.rope import apply_rope, apply_rope_qk, rope_cos_sin

    torch.manual_seed(tokens)
    qkv = torch.randn(tokens, (8 + 2 * 2) * 64) * 3
    q, k = qkv[:, :512].view(tokens, 8, 64), qkv[:, 512:640].view(tokens, 2, 64)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    cos, sin = (t.unsqueeze(-2) for t in rope_cos_sin(inv_freq, torch.arange(tokens) * 3 + 5, torch.float32))
    if batched:
        q, k, cos, sin = q[None], k[None], cos[None], sin[None]
    calls = []

    class Counting:
        def rope(self, *args):
            calls.append(args[0].shape)
            return kernel.rope(*args)

    with torch.no_grad():
        fused = apply_rope_qk(q, k, cos, sin, Counting())
        separate = apply_rope_qk(q, k.clone(), cos, sin, Counting())  # not adjacent: q and k each
    assert [tuple(shape) for shape in calls] == [(tokens, 10, 64), (tokens, 8, 64), (tokens, 2, 64)]
    for got in (fused, separate):
        torch.testing.assert_close(got[0], apply_rope(q, cos, sin), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], apply_rope(k, cos, sin), rtol=1e-5, atol=1e-6)


@needs_kernel
def test_fused_ops_leave_the_models_forward_unchanged():
    """The no-grad forward with serving's ops (packed GEMMs, fused RMSNorm, SwiGLU and RoPE by the
    kernels) gives the logits of the plain forward."""
    from shiftlm.config import ModelConfig
    from shiftlm.model import build_model
    from shiftlm.model.inference_linear import PackedWeights
    from shiftlm.model.ops import InferenceOps

    model = build_model(ModelConfig(vocab_size=300), seed=0).eval()
    ids = torch.randint(0, 300, (1, 40))
    with torch.no_grad():
        plain = model(ids)
        packed = PackedWeights(kernel)
        fused = model(ids, ops=InferenceOps(packed))
    assert len(packed) > 0  # the packed path really ran
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-5)


def test_without_a_compiler_serving_falls_back_with_one_warning(tmp_path, monkeypatch, caplog, capsys):
    """Where the kernels cannot be built (no C++ compiler): `load()` is None with one warning naming the
    reason, `auto` serves with gather + SDPA and PyTorch's norm and SwiGLU, and `cpu-kernel` refuses to
    start with one line naming the fix."""
    from torch.utils import cpp_extension

    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner
    from shiftlm.tools.tiny import make_tiny_checkpoint

    def no_compiler(**_):
        raise RuntimeError("Error building extension\ncommand 'c++' not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path / name))
    monkeypatch.setattr(cpu_kernels, "_state", {})
    model_dir = make_tiny_checkpoint(tmp_path / "m", "llama-gqa")
    with caplog.at_level("WARNING", logger=cpu_kernels.__name__):
        runner = ModelRunner.load(model_dir, Mesh(ParallelConfig()), 16, 4, attention_backend="auto")
        assert cpu_kernels.load() is None  # cached: not built again, no second warning
    warnings = [r.getMessage() for r in caplog.records if r.name == cpu_kernels.__name__]
    # a first build says so before it starts (a progress line; nothing cached under tmp_path), then
    # warns once why it failed
    announced = [line for line in capsys.readouterr().err.splitlines() if "first start only" in line]
    assert len(announced) == 1 and str(tmp_path) in announced[0]
    assert len(warnings) == 1 and "could not be built (command 'c++' not found)" in warnings[0]
    assert runner.cache.kernel is None and runner.shift_model.packed.ops is None
    with pytest.raises(ConfigError, match="install a C\\+\\+ compiler or use --attention-backend auto"):
        ModelRunner.load(model_dir, Mesh(ParallelConfig()), 16, 4, attention_backend="cpu-kernel")


@needs_kernel
@pytest.mark.parametrize(("family", "block"), [("llama-gqa", 16), ("mistral", 4), ("qwen2", 16)])
def test_prefill_chunks_by_the_kernel_equal_sdpa(tmp_path, family, block):
    """Prefill chunks (several query rows of a sequence, in tiles of 16), from position 0 and after
    earlier context, of unequal lengths (padded rows), beside decode rows, with a sliding window
    (mistral's 6) and both block sizes: the kernel's logits equal the gather + SDPA path's."""
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan
    from shiftlm.serve.worker.runner import ModelRunner
    from shiftlm.tools.tiny import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(tmp_path / family, family)
    runners = {
        backend: ModelRunner.load(
            model_dir, Mesh(ParallelConfig()), num_blocks=96, block_size=block, attention_backend=backend
        )
        for backend in ("sdpa", "cpu-kernel")
    }
    per_seq = 96 // 3

    def chunk(seq: int, start: int, count: int, first: bool) -> ScheduledChunk:
        tokens = tuple((7 * seq + 3 * i) % 200 + 1 for i in range(start, start + count))
        blocks = tuple(range(seq * per_seq, seq * per_seq + per_seq)) if first else ()
        return ScheduledChunk(seq, tokens, start, blocks, True, row=seq)

    plans = [
        StepPlan(0, Mode.TP, (chunk(0, 0, 37, True), chunk(1, 0, 20, True))),
        StepPlan(1, Mode.TP, (chunk(0, 37, 21, False), chunk(1, 20, 1, False), chunk(2, 0, 5, True))),
    ]
    for plan in plans:
        want, got = (runners[b].execute(plan) for b in ("sdpa", "cpu-kernel"))
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), plan.step
