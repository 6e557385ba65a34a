"""RoPE of q and k in one pass (fused QKV outputs) equals `apply_rope` of each, bit for bit."""

from __future__ import annotations

import pytest
import torch

from shiftlm.model.rope import apply_rope, apply_rope_qk


@pytest.mark.parametrize("tokens", [1, 5])
def test_rope_qk_one_pass_equals_each(tokens):
    torch.manual_seed(0)
    heads, kv, d = 4, 2, 8
    fused = torch.randn(1, tokens, (heads + 2 * kv) * d)  # one GEMM's output: q | k | v
    q, k, _ = (t.view(1, tokens, -1, d) for t in fused.split([heads * d, kv * d, kv * d], dim=-1))
    cos, sin = torch.randn(1, tokens, 1, d), torch.randn(1, tokens, 1, d)
    q_rot, k_rot = apply_rope_qk(q, k, cos, sin)
    assert q_rot.data_ptr() + heads * d * 4 == k_rot.data_ptr()  # computed together, in one tensor
    assert torch.equal(q_rot, apply_rope(q, cos, sin)) and torch.equal(k_rot, apply_rope(k, cos, sin))
    # separate tensors (autograd's path, GEMV-sized inputs): each on its own, the same values
    q2, k2 = apply_rope_qk(q.clone(), k.clone(), cos[..., 0, :], sin[..., 0, :])
    assert torch.equal(q2, q_rot) and torch.equal(k2, k_rot)
