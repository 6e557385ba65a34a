"""Causal self-attention with tensor parallelism over heads and Ulysses sequence parallelism.

Ulysses (Jacobs et al. 2023): each SP rank holds a contiguous slice of the sequence and its TP shard
of heads. One all-to-all over the sp group trades "my tokens, my TP block's heads" for "all tokens,
one sub-block of heads"; afterwards rank (sp, tp) holds head block j = tp*SP + sp of P = SP*TP
(docs/design.md "Shift Parallelism"). Q, K and V travel in one all-to-all, the output in a second one.
With fewer KV heads than blocks, each block receives the KV head floor(j*KV/P) it attends with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shiftlm.comm import CommGroup, all_to_all_along
from shiftlm.config import ModelConfig
from shiftlm.model.layers import ColumnParallelLinear, RowParallelLinear
from shiftlm.model.ring_attention import ring_attention
from shiftlm.model.rope import apply_rope
from shiftlm.model.sharding import kv_heads_of_block

HEAD_DIM_AXIS = 2  # activations are [batch, tokens, heads, head_dim]


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """q: [B, S, Hq, D], k/v: [B, S, Hkv, D] with Hq a multiple of Hkv -> [B, S, Hq, D]."""
    # GQA: query head h attends with KV head h // groups; SDPA broadcasts without copying K and V
    gqa = q.shape[2] != k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    seq = q.shape[2]
    if sliding_window is not None and sliding_window < seq:
        pos = torch.arange(seq, device=q.device)
        distance = pos.unsqueeze(1) - pos.unsqueeze(0)
        mask = (distance >= 0) & (distance < sliding_window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        tp: CommGroup,
        sp: CommGroup,
        sequence_parallel: bool = False,
        cp: CommGroup | None = None,
    ):
        super().__init__()
        d = config.head_dim
        self.config = config
        self.tp, self.sp = tp, sp
        self.cp = cp if cp is not None and cp.size > 1 else None  # context parallel: ring attention
        self.heads_local = config.num_heads // tp.size
        first, last = kv_heads_of_block(tp.rank, tp.size, config.num_kv_heads)
        self.kv_heads_local = last - first
        h = config.hidden_size
        bias = config.attention_bias
        self.q_proj = ColumnParallelLinear(h, self.heads_local * d, tp, bias, sequence_parallel)
        self.k_proj = ColumnParallelLinear(h, self.kv_heads_local * d, tp, bias, sequence_parallel)
        self.v_proj = ColumnParallelLinear(h, self.kv_heads_local * d, tp, bias, sequence_parallel)
        self.o_proj = RowParallelLinear(self.heads_local * d, h, tp, sequence_parallel)
        # Ulysses: which of my local KV heads each destination sp rank (head block j) needs
        blocks = tp.size * sp.size
        kv_index = []
        for s in range(sp.size):
            lo, hi = kv_heads_of_block(tp.rank * sp.size + s, blocks, config.num_kv_heads)
            kv_index.extend(range(lo - first, hi - first))
        self.register_buffer("kv_index", torch.tensor(kv_index, dtype=torch.long), persistent=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [B, S_local, hidden] (S_local/TP with sequence parallelism); cos/sin: [B, S_local, D]."""
        d = self.config.head_dim
        x = self.q_proj.enter(x)
        batch, tokens = x.shape[:2]
        q = self.q_proj(x, entered=True).view(batch, tokens, self.heads_local, d)
        k = self.k_proj(x, entered=True).view(batch, tokens, self.kv_heads_local, d)
        v = self.v_proj(x, entered=True).view(batch, tokens, self.kv_heads_local, d)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.sp.size > 1:
            q, k, v = self.scatter_heads(q, k, v)
        if self.cp is not None:  # backend: the cp rank's zigzag chunks, K/V around the cp ring
            out = ring_attention(q, k, v, self.cp)
        else:
            out = causal_attention(q, k, v, self.config.sliding_window)
        if self.sp.size > 1:
            out = all_to_all_along(out, self.sp, scatter_dim=1, gather_dim=HEAD_DIM_AXIS)
        return self.o_proj(out.reshape(batch, -1, self.heads_local * d))

    def scatter_heads(self, q, k, v):
        """One all-to-all: [B, S/SP, (q, k, v) of my TP block] -> [B, S, (q, k, v) of head block j]."""
        sp = self.sp.size
        batch, tokens, _, d = q.shape
        q_per = self.heads_local // sp
        kv_per = self.kv_index.numel() // sp
        k, v = k[:, :, self.kv_index], v[:, :, self.kv_index]
        packed = torch.cat(
            (
                q.view(batch, tokens, sp, q_per, d),
                k.view(batch, tokens, sp, kv_per, d),
                v.view(batch, tokens, sp, kv_per, d),
            ),
            dim=3,
        ).flatten(2, 3)
        packed = all_to_all_along(packed, self.sp, scatter_dim=HEAD_DIM_AXIS, gather_dim=1)
        return packed.split((q_per, kv_per, kv_per), dim=HEAD_DIM_AXIS)
