"""Causal self-attention with tensor parallelism over heads and Ulysses sequence parallelism.

Ulysses (Jacobs et al. 2023): each SP rank holds a contiguous slice of the sequence and its TP shard
of heads. One all-to-all over the sp group trades "my tokens, my TP block's heads" for "all tokens,
one sub-block of heads"; afterwards rank (sp, tp) holds head block j = tp*SP + sp of P = SP*TP
(docs/design.md "Shift Parallelism"). Q, K and V travel in one all-to-all, the output in a second one.
With fewer KV heads than blocks, each block receives the KV head floor(j*KV/P) it attends with.

The attention itself is a backend seam: by default dense causal SDPA (training); serving passes a paged
backend (serve/worker/paged_attention.py) that writes K/V into its cache and reads each sequence's context.
With `FullTP` the same layer runs as tensor parallelism over all P ranks of the shift group (Shift
Parallelism's latency mode): rank (sp, tp) uses head block j = tp*SP + sp, which is sub-slice sp of its
TP shard, as `narrow` views of its own weights, and sums the row-parallel output over all P ranks.
Either way the backend sees the K/V of head block j, so both modes share one KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from shiftlm.comm import CommGroup, all_to_all_along, reduce_from_group
from shiftlm.config import ModelConfig
from shiftlm.model.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear
from shiftlm.model.ops import PLAIN, Ops
from shiftlm.model.ring_attention import ring_attention
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


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, S, Hq, D], k/v: [B, S, Hkv, D] (RoPE applied, this rank's head block) -> [B, S, Hq, D]."""


@dataclass(frozen=True)
class FullTP:
    """Run a layer as tensor parallelism over all P = SP*TP ranks of `group` (the shift group): rank
    (sp, tp) computes sub-slice `part` = sp of `parts` = SP of its TP shard (views, no copies)."""

    group: CommGroup
    part: int
    parts: int

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel output summed over all P ranks (traced into a compiled graph as a custom op)."""
        return reduce_from_group(x, self.group)


@dataclass(frozen=True)
class _Views:
    """The projections one full-TP rank uses: views into its TP shard's weights."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None


def _narrow(tensor: torch.Tensor | None, dim: int, start: int, length: int) -> torch.Tensor | None:
    return None if tensor is None else tensor.narrow(dim, start, length)


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        tp: CommGroup,
        sp: CommGroup,
        sequence_parallel: bool = False,
        cp: CommGroup | None = None,
        layer_index: int = 0,
    ):
        super().__init__()
        d = config.head_dim
        self.config = config
        self.tp, self.sp = tp, sp
        self.cp = cp if cp is not None and cp.size > 1 else None  # context parallel: ring attention
        self.layer_index = layer_index  # global index: the key of this layer's K/V in a serving cache
        self.heads_local = config.num_heads // tp.size
        first, last = kv_heads_of_block(tp.rank, tp.size, config.num_kv_heads)
        self.kv_heads_local = last - first
        h = config.hidden_size
        bias = config.attention_bias
        self.q_proj = ColumnParallelLinear(h, self.heads_local * d, tp, bias, sequence_parallel)
        self.k_proj = ColumnParallelLinear(h, self.kv_heads_local * d, tp, bias, sequence_parallel)
        self.v_proj = ColumnParallelLinear(h, self.kv_heads_local * d, tp, bias, sequence_parallel)
        self.o_proj = RowParallelLinear(self.heads_local * d, h, tp, sequence_parallel)
        if config.qk_norm:  # qwen3: RMSNorm over each query and key head, before RoPE
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        # Ulysses: which of my local KV heads each destination sp rank (head block j) needs
        blocks = tp.size * sp.size
        kv_index = []
        for s in range(sp.size):
            lo, hi = kv_heads_of_block(tp.rank * sp.size + s, blocks, config.num_kv_heads)
            kv_index.extend(range(lo - first, hi - first))
        self.register_buffer("kv_index", torch.tensor(kv_index, dtype=torch.long), persistent=False)
        self._views: tuple[tuple, _Views] | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend | None = None,
        full_tp: FullTP | None = None,
        ops: Ops = PLAIN,
    ) -> torch.Tensor:
        """x: [B, S_local, hidden] (S_local/TP with sequence parallelism); cos/sin: [B, S_local, D].

        `backend` replaces dense causal attention (serving: paged); `full_tp` runs the layer as P-way
        tensor parallelism (every rank sees all tokens) instead of TP shards with Ulysses over sp;
        `ops` runs the projections, norms and RoPE (model/ops.py)."""
        if full_tp is not None:
            return self._forward_full_tp(x, cos, sin, backend, full_tp, ops)
        d = self.config.head_dim
        x = self.q_proj.enter(x)
        batch, tokens = x.shape[:2]
        projections = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = ops.linears(x, tuple(p.weight for p in projections), tuple(p.bias for p in projections))
        q, k, v = (t.view(batch, tokens, -1, d) for t in (q, k, v))
        if self.config.qk_norm:
            q, k = self.q_norm(q, ops), self.k_norm(k, ops)
        q, k = ops.rope_qk(q, k, cos, sin)
        if self.sp.size > 1:
            q, k, v = self.scatter_heads(q, k, v)
        if backend is not None:  # serving: paged attention over the KV cache
            out = backend(self.layer_index, q, k, v)
        elif self.cp is not None:  # the cp rank's zigzag chunks, K/V around the cp ring
            out = ring_attention(q, k, v, self.cp)
        else:
            out = causal_attention(q, k, v, self.config.sliding_window)
        if self.sp.size > 1:
            out = all_to_all_along(out, self.sp, scatter_dim=1, gather_dim=HEAD_DIM_AXIS)
        return self.o_proj(out.reshape(batch, -1, self.heads_local * d), ops)

    def _forward_full_tp(
        self, x, cos, sin, backend: AttentionBackend | None, full_tp: FullTP, ops: Ops
    ) -> torch.Tensor:
        d, views = self.config.head_dim, self.full_tp_views(full_tp)
        batch, tokens = x.shape[:2]
        q, k, v = ops.linears(x, (views.q, views.k, views.v), (views.q_bias, views.k_bias, views.v_bias))
        q, k, v = (t.view(batch, tokens, -1, d) for t in (q, k, v))
        if self.config.qk_norm:
            q, k = self.q_norm(q, ops), self.k_norm(k, ops)
        q, k = ops.rope_qk(q, k, cos, sin)
        if backend is None:
            out = causal_attention(q, k, v, self.config.sliding_window)
        else:
            out = backend(self.layer_index, q, k, v)
        return full_tp.reduce(ops.linear(out.reshape(batch, tokens, -1), views.o))

    def full_tp_views(self, full_tp: FullTP) -> _Views:
        """Head block j = tp*SP + sp of P as views into TP shard tp (sub-slice sp); taken once, after
        the weights are loaded (they are updated in place, never replaced, so the views stay valid)."""
        if torch.compiler.is_compiling():  # inside a graph the narrows are free: no cache, no data_ptr
            return self._make_views(full_tp)
        key = (full_tp.part, full_tp.parts, self.q_proj.weight.data_ptr())
        if self._views is None or self._views[0] != key:
            self._views = (key, self._make_views(full_tp))
        return self._views[1]

    def _make_views(self, full_tp: FullTP) -> _Views:
        config, d = self.config, self.config.head_dim
        q_rows = self.heads_local // full_tp.parts * d
        tp_first_kv, _ = kv_heads_of_block(self.tp.rank, self.tp.size, config.num_kv_heads)
        block = self.tp.rank * full_tp.parts + full_tp.part
        kv_first, kv_last = kv_heads_of_block(block, self.tp.size * full_tp.parts, config.num_kv_heads)
        kv_start, kv_rows = (kv_first - tp_first_kv) * d, (kv_last - kv_first) * d
        q_start = full_tp.part * q_rows
        return _Views(
            q=self.q_proj.weight.narrow(0, q_start, q_rows),
            k=self.k_proj.weight.narrow(0, kv_start, kv_rows),
            v=self.v_proj.weight.narrow(0, kv_start, kv_rows),
            o=self.o_proj.weight.narrow(1, q_start, q_rows),
            q_bias=_narrow(self.q_proj.bias, 0, q_start, q_rows),
            k_bias=_narrow(self.k_proj.bias, 0, kv_start, kv_rows),
            v_bias=_narrow(self.v_proj.bias, 0, kv_start, kv_rows),
        )

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
