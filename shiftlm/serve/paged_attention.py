"""The paged KV cache and attention over a flattened, variable-length batch.

A step's tokens (prefill chunks and decode tokens of every sequence) are concatenated into one row of
N tokens (`FlatBatch`). The cache of one rank is one tensor allocated once,
[layers, 2 (K, V), num_blocks * block_size slots, kv heads of head block j, head_dim]; a token's K/V go
to slot `block * block_size + offset` and never move. The rank's head block j and its KV heads are the
same in full-TP and SP x TP mode, so both modes read and write the very same tensor (KV invariance).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shiftlm.serve.scheduler import StepPlan


@dataclass(frozen=True)
class ChunkView:
    """Where one sequence's chunk sits in the flat batch, and the slots of its whole context."""

    offset: int  # first row of the chunk in the flat batch
    positions: torch.Tensor  # [len] positions of the chunk's tokens
    context_slots: torch.Tensor  # [start + len] slots of positions 0 .. start + len - 1


@dataclass(frozen=True)
class FlatBatch:
    token_ids: torch.Tensor  # [N_padded]
    positions: torch.Tensor  # [N_padded]
    slots: torch.Tensor  # [N_padded], -1 for padding rows
    chunks: tuple[ChunkView, ...]
    sample_rows: torch.Tensor  # rows whose logits are wanted, in plan order (ScheduledChunk.num_logits_rows)
    num_tokens: int  # N before padding


def flatten_plan(plan: StepPlan, block_size: int, pad_to_multiple: int = 1) -> FlatBatch:
    """Build the step's tensors from the plan; every rank computes the same thing from the same plan."""
    token_ids, positions, slots, chunks, sample_rows = [], [], [], [], []
    for chunk in plan.chunks:
        end = chunk.start + len(chunk.token_ids)
        blocks = torch.tensor(chunk.block_ids, dtype=torch.long)
        context = torch.arange(end)
        context_slots = blocks[context // block_size] * block_size + context % block_size
        chunks.append(ChunkView(len(token_ids), context[chunk.start :], context_slots))
        token_ids += chunk.token_ids
        positions += range(chunk.start, end)
        slots += context_slots[chunk.start :].tolist()
        if chunk.all_logits:
            sample_rows += range(len(token_ids) - len(chunk.token_ids), len(token_ids))
        elif chunk.sample:
            sample_rows.append(len(token_ids) - 1)
    num_tokens = len(token_ids)
    padding = -num_tokens % pad_to_multiple
    return FlatBatch(
        token_ids=torch.tensor(token_ids + [0] * padding, dtype=torch.long),
        positions=torch.tensor(positions + [0] * padding, dtype=torch.long),
        slots=torch.tensor(slots + [-1] * padding, dtype=torch.long),
        chunks=tuple(chunks),
        sample_rows=torch.tensor(sample_rows, dtype=torch.long),
        num_tokens=num_tokens,
    )


class PagedKVCache:
    """K/V of this rank's head block for every layer, allocated once and written in place."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.block_size = block_size
        shape = (num_layers, 2, num_blocks * block_size, kv_heads, head_dim)
        self.storage = torch.zeros(shape, dtype=dtype, device=device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [N, kv_heads, head_dim] of the real (slot >= 0) rows, in place."""
        real = slots >= 0
        self.storage[layer, 0].index_copy_(0, slots[real], k[real])
        self.storage[layer, 1].index_copy_(0, slots[real], v[real])

    def attend(
        self, layer: int, q: torch.Tensor, batch: FlatBatch, sliding_window: int | None
    ) -> torch.Tensor:
        """Causal attention of q [N, Hq, D] over each sequence's cached context -> [N, Hq, D]."""
        out = torch.zeros_like(q)
        k_cache, v_cache = self.storage[layer, 0], self.storage[layer, 1]
        for chunk in batch.chunks:
            rows = slice(chunk.offset, chunk.offset + chunk.positions.numel())
            k, v = k_cache[chunk.context_slots], v_cache[chunk.context_slots]
            key_positions = torch.arange(chunk.context_slots.numel())
            distance = chunk.positions.unsqueeze(1) - key_positions.unsqueeze(0)
            mask = distance >= 0
            if sliding_window is not None:
                mask &= distance < sliding_window
            attended = F.scaled_dot_product_attention(  # GQA: query head h reads KV head h // groups
                q[rows].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
            )
            out[rows] = attended.transpose(0, 1)
        return out
