"""Ring attention (cp ranks, zigzag split) computes causal attention: outputs and q/k/v gradients
equal one-process SDPA; whole models with cp layouts equal Hugging Face and the single-rank model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shiftlm.config import ModelConfig
from shiftlm.errors import ConfigError
from shiftlm.mesh import Mesh
from shiftlm.model.ring_attention import sequence_indices, unzigzag, zigzag_indices
from shiftlm.parallel import ParallelConfig
from shiftlm.tools.parity import layout_outputs, reference_outputs, relative_error

TOLERANCE = 1e-5
SEQ = 24  # not a power of two; 24 = 2*cp*sp*3 for cp=4, and cp=2 x sp=2


def _random_qkv(batch, seq, heads, kv_heads, dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, seq, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    return q, k, v, torch.randn(batch, seq, heads, dim, generator=gen)


def _ring_vs_sdpa(cp, seq, heads, kv_heads, dtype=torch.float32, kernel="auto"):
    """Per rank: relative errors of (out, dq, dk, dv) of ring attention vs SDPA on the whole sequence;
    kernel="math" runs the plain-matmul block kernel (what non-CPU devices use)."""
    from shiftlm.model import ring_attention as ring

    saved = ring._FLASH_CPU
    if kernel == "math":
        ring._FLASH_CPU = None
    try:
        return _ring_errors(cp, seq, heads, kv_heads, dtype, ring.ring_attention)
    finally:
        ring._FLASH_CPU = saved


def _ring_errors(cp, seq, heads, kv_heads, dtype, ring_attention):
    mesh = Mesh(ParallelConfig(cp=cp))
    q, k, v, dout = _random_qkv(2, seq, heads, kv_heads, 8)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, enable_gqa=heads != kv_heads
    ).transpose(1, 2)
    ref.backward(dout)
    index = torch.from_numpy(zigzag_indices(seq, cp, mesh.cp.rank))
    mine = [t.detach()[:, index].to(dtype).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, mesh.cp)
    out.backward(dout[:, index].to(dtype))
    pairs = [(out, ref)] + [(m.grad, t.grad) for m, t in zip(mine, (q, k, v))]
    return [relative_error(a.float(), b[:, index])[1] for a, b in pairs]


@pytest.mark.parametrize(
    "cp,heads,kv_heads,kernel", [(2, 4, 4, "auto"), (2, 4, 2, "auto"), (4, 4, 1, "auto"), (2, 4, 2, "math")]
)
def test_ring_attention_output_and_grads_equal_sdpa(ranks, cp, heads, kv_heads, kernel):
    for rank_errors in ranks.run(cp, _ring_vs_sdpa, cp, SEQ, heads, kv_heads, torch.float32, kernel):
        assert max(rank_errors) <= TOLERANCE, rank_errors  # out, dq, dk, dv


def test_ring_attention_in_bf16_stays_close_to_fp32_sdpa(ranks):
    """bf16 inputs, fp32 softmax merge: errors at bf16 rounding, not at accumulation blow-up."""
    for rank_errors in ranks.run(2, _ring_vs_sdpa, 2, SEQ, 4, 2, torch.bfloat16):
        assert max(rank_errors) <= 2e-2, rank_errors


def test_zigzag_split_covers_the_sequence_once_and_balances_causal_work():
    for cp, sp in [(2, 1), (4, 1), (2, 2), (3, 2)]:
        seq = 2 * cp * sp * 5
        parts = [sequence_indices(seq, cp, c, sp, s) for c in range(cp) for s in range(sp)]
        assert sorted(np.concatenate(parts).tolist()) == list(range(seq))
        # causal work of cp rank r: sum over its queries of (position + 1) keys; equal on every rank
        work = {int((zigzag_indices(seq, cp, r) + 1).sum()) for r in range(cp)}
        assert len(work) == 1
    gathered = torch.cat([torch.from_numpy(zigzag_indices(20, 2, r)) for r in range(2)]).unsqueeze(0)
    assert unzigzag(gathered, 2).squeeze(0).tolist() == list(range(20))


def test_bad_sequence_lengths_name_the_fix():
    with pytest.raises(ConfigError, match=r"2\*cp\*sp = 8 equal chunks.*multiple of 8, e.g. 24"):
        ParallelConfig(cp=2, sp=2).check_sequence(20)
    with pytest.raises(
        ConfigError, match=r"2\*cp\*sp = 16 is larger than the sequence length 8: lower cp or sp"
    ):
        ParallelConfig(cp=4, sp=2).check_sequence(8)
    with pytest.raises(ConfigError, match=r"sliding-window.*use cp = 1"):
        ParallelConfig(cp=2).check_model(ModelConfig(sliding_window=6, model_type="mistral"))
    ParallelConfig(cp=2, sp=2).check_sequence(24)  # a valid one passes


# (cp, sp, tp): cp alone, cp with Ulysses, cp with tensor parallelism
LAYOUTS = [(2, 1, 1), (4, 1, 1), (2, 2, 1), (2, 1, 2)]
FAMILIES = ["llama", "llama-gqa", "qwen2"]
_cache: dict = {}


def _reference(checkpoint):
    if ("hf", checkpoint) not in _cache:
        _cache[("hf", checkpoint)] = reference_outputs(checkpoint, seq_len=SEQ, param_grads=True)
    return _cache[("hf", checkpoint)]


def _single(ranks, checkpoint):
    if ("one", checkpoint) not in _cache:
        _cache[("one", checkpoint)] = ranks.run(1, layout_outputs, checkpoint, seq_len=SEQ, param_grads=True)[
            0
        ]
    return _cache[("one", checkpoint)]


def _assert_close(name, ours, reference):
    abs_err, rel_err = relative_error(ours, reference)
    assert rel_err <= TOLERANCE, f"{name}: max abs {abs_err:.3g}, relative {rel_err:.3g} > {TOLERANCE}"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cp,sp,tp", LAYOUTS, ids=lambda v: str(v))
def test_cp_layout_matches_hf_and_one_rank(ranks, tiny_checkpoints, family, cp, sp, tp):
    checkpoint = tiny_checkpoints[family]
    outputs = ranks.run(
        cp * sp * tp, layout_outputs, checkpoint, tp=tp, sp=sp, cp=cp, seq_len=SEQ, param_grads=True
    )
    ours, single, reference = outputs[0], _single(ranks, checkpoint), _reference(checkpoint)
    _assert_close("logits vs HF", ours.logits, reference.logits)
    _assert_close("input-embedding grad vs HF", ours.embedding_grad, reference.embedding_grad)
    _assert_close("logits vs one rank", ours.logits, single.logits)
    _assert_close("input-embedding grad vs one rank", ours.embedding_grad, single.embedding_grad)
    assert ours.param_grads.keys() == single.param_grads.keys()
    for name, grad in ours.param_grads.items():
        _assert_close(f"{name} grad vs one rank", grad, single.param_grads[name])
    for other in outputs[1:]:
        assert torch.equal(other.logits, ours.logits)


def _build_mistral_with_cp():
    from shiftlm.model import build_model

    return build_model(ModelConfig(sliding_window=6, model_type="mistral"), Mesh(ParallelConfig(cp=2)))


def test_sliding_window_model_is_refused_at_cp2(ranks):
    with pytest.raises(Exception, match="does not support sliding-window attention"):
        ranks.run(2, _build_mistral_with_cp)


@pytest.mark.parametrize("causal", [True, False])
def test_flash_block_kernel_equals_the_matmul_block_kernel(causal):
    """The CPU flash kernel path (folded GQA rows) and the plain-matmul path give the same block
    output, log-sum-exp and gradients (given a final output and lse, as the ring backward does)."""
    from shiftlm.model import ring_attention as ring

    gen = torch.Generator().manual_seed(3)
    b, kv, g, tq, d = 2, 2, 3, 6, 8
    tk = tq if causal else 2 * tq
    q, dout = torch.randn(b, kv, g, tq, d, generator=gen), torch.randn(b, kv, g, tq, d, generator=gen)
    k, v = torch.randn(b, kv, tk, d, generator=gen), torch.randn(b, kv, tk, d, generator=gen)
    assert ring._use_flash(q)
    flash = ring._block_forward(q, k, v, causal, 0.3)
    math = ring._math_forward(q, k, v, causal, 0.3)
    for a, m in zip(flash, math):
        assert relative_error(a, m)[1] <= TOLERANCE
    out, lse = math
    grads = ring._block_backward(dout, q, k, v, out, lse, causal, 0.3)
    for a, m in zip(grads, ring._math_backward(dout, q, k, v, out, lse, causal, 0.3)):
        assert relative_error(a, m)[1] <= TOLERANCE
