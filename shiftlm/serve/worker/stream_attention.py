"""Hogwild! attention with query rotation over the paged cache.

In the hogwild layout (model/stream_mask.py) every viewer sees the other workers' tokens at positions
of its own view, which change as the workers write. The cached keys keep the rotation of the position
they were written at; the viewer's query, already rotated to its own position p, is rotated once
more per key block b (the prompt, then each worker) by `shift[q, b]`: R(p + shift)·q = R(shift)·R(p)·q,
so q·k sees exactly the view's relative distance (Rodionov et al. 2025, "query rotation"). With B key
blocks the step computes B query-key products per query and keeps, for each key, the one of its block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shiftlm.model.rope import apply_rope, rope_cos_sin


@dataclass(frozen=True)
class QueryRotation:
    """cos/sin [S, Q, B, D] of each query's extra rotation per key block; key_block [S, C] (0: the
    prompt, 1 + j: worker j) says which rotation each context slot is read with."""

    cos: torch.Tensor
    sin: torch.Tensor
    key_block: torch.Tensor

    @classmethod
    def build(
        cls, shift: torch.Tensor, k_stream: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
    ) -> QueryRotation:
        """From the per-key shift [S, Q, C] of `stream_visibility` (one value per key block and query)."""
        key_block = k_stream + 1  # prompt (-1) -> block 0
        blocks = int(key_block.max()) + 1
        per_block = shift.new_zeros(*shift.shape[:-1], blocks)
        per_block.scatter_(-1, key_block.unsqueeze(1).expand(shift.shape), shift)
        cos, sin = rope_cos_sin(inv_freq, per_block, dtype)
        return cls(cos, sin, key_block)

    def to(self, device: torch.device) -> QueryRotation:
        return QueryRotation(*(t.to(device, non_blocking=True) for t in (self.cos, self.sin, self.key_block)))


def rotated_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, rotation: QueryRotation
) -> torch.Tensor:
    """q: [S, Q, Hq, D] (rotated at the query's own position), k/v: [S, Hkv, C, D] from the cache,
    mask [S, 1, Q, C] -> [S, Q, Hq, D]; softmax in fp32, as SDPA on these inputs."""
    seqs, queries, heads, d = q.shape
    kv_heads, blocks = k.shape[1], rotation.cos.shape[2]
    groups = heads // kv_heads
    cos = rotation.cos.to(q.dtype)[:, :queries]
    sin = rotation.sin.to(q.dtype)[:, :queries]
    rotated = apply_rope(q.unsqueeze(2).expand(seqs, queries, blocks, heads, d), cos, sin)
    rotated = rotated.view(seqs, queries, blocks, kv_heads, groups, d).permute(0, 2, 3, 4, 1, 5)
    scores = torch.matmul(rotated, k.unsqueeze(1).unsqueeze(3).transpose(-1, -2))  # [S, B, Hkv, g, Q, C]
    pick = rotation.key_block.view(seqs, 1, 1, 1, 1, -1).expand(seqs, 1, kv_heads, groups, queries, -1)
    scores = torch.gather(scores, 1, pick).squeeze(1).float() / math.sqrt(d)  # [S, Hkv, g, Q, C]
    scores = scores.masked_fill(~mask.view(seqs, 1, 1, queries, -1), float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(weights, v.unsqueeze(2))  # [S, Hkv, g, Q, D]
    return out.permute(0, 3, 1, 2, 4).reshape(seqs, queries, heads, d)
