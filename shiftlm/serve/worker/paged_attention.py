"""The paged KV cache and batched attention over a flattened, variable-length step.

A step's tokens (prefill chunks and decode tokens of every sequence) are concatenated into one row of
N tokens (`FlatBatch`). The cache of one rank is one tensor allocated once,
[layers, 2 (K, V), num_blocks * block_size slots, kv heads of head block j, head_dim]; a token's K/V go
to slot `block * block_size + offset` and never move. The rank's head block j and its KV heads are the
same in full-TP and SP x TP mode, so both modes read and write the very same tensor (KV invariance).

Attention is batched (PagedAttention's idea, Kwon et al., SOSP 2023, with stock PyTorch ops): per layer
one `index_select` gathers the context blocks of every sequence of a group into [seqs, context, kv, D]
and one `scaled_dot_product_attention` call attends all of them, with a mask that is causal and cuts
each sequence at its own length. A step has at most two groups, decode rows (one query each) and
prefill chunks (padded to the longest chunk), so that a long prefill does not pad every decode. Query
heads sharing a KV head are folded into the query axis (GQA without repeating K/V). The masks and the
gather indices are built once per step and shared by all layers; no Python loop runs over sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from shiftlm.serve.worker.flex_decode import flex_decode, flex_plan
from shiftlm.serve.worker.stream_attention import QueryRotation, rotated_attention


@dataclass
class AttentionGroup:
    """Sequences attended by one SDPA call: `queries` of each padded to Q, contexts padded to C."""

    query_rows: torch.Tensor  # [S, Q] rows of the flat batch (padding repeats a real row)
    query_valid: torch.Tensor | None  # [S, Q] False on padding; None when nothing is padded
    mask: torch.Tensor  # [S, 1, Q, C] True where query i may read key position c
    block_index: torch.Tensor  # [S * C / block_size] physical blocks, sequence-major
    _folded: dict = field(default_factory=dict)  # mask per GQA group size; bias per dtype; flex's mask
    # hogwild stream groups: the queries' extra RoPE rotation per key block (serve/worker/stream_attention.py)
    rotation: QueryRotation | None = None
    # causal groups (not stream groups): each query's position [S, Q] and the sliding window (0: none),
    # which is all the CPU kernel needs instead of the mask
    query_pos: torch.Tensor | None = None
    window: int = 0
    # every chunk starts at position 0 and no window cuts it: SDPA's own causal mask (is_causal) applies
    from_start: bool = False
    # where query_valid is True, as flat indices into [S * Q]: made where the group is made (on the
    # host, from the plan), since a boolean index on a GPU waits for it (nonzero), twice a layer
    valid_index: torch.Tensor | None = None

    def __post_init__(self):
        if self.query_valid is not None and self.valid_index is None:
            self.valid_index = self.query_valid.flatten().nonzero().flatten()

    def to(self, device: torch.device) -> AttentionGroup:
        """This group's tensors on `device` (the plan is decoded on the host: `FlatBatch.to`)."""
        return replace(
            self,
            query_rows=_to(self.query_rows, device),
            query_valid=_to(self.query_valid, device),
            mask=_to(self.mask, device),
            block_index=_to(self.block_index, device),
            _folded={},
            rotation=None if self.rotation is None else self.rotation.to(device),
            query_pos=_to(self.query_pos, device),
            valid_index=_to(self.valid_index, device),
        )

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask as SDPA's additive bias (0 or -inf), made once per step: a boolean mask is
        converted by SDPA on every call (3 ops per layer)."""
        if dtype not in self._folded:
            zero = torch.zeros((), dtype=dtype, device=self.mask.device)
            self._folded[dtype] = zero.masked_fill(~self.mask, float("-inf"))
        return self._folded[dtype]

    def flex_mask(self, block_size: int, slots: int) -> list[torch.Tensor]:
        """FlexAttention's block mask of this group of decode rows (`flex_plan`), made once per step."""
        if "flex" not in self._folded:
            self._folded["flex"] = flex_plan(self.block_index, self.query_pos, self.window, block_size, slots)
        return self._folded["flex"]

    def folded_mask(self, groups: int) -> torch.Tensor:
        """The mask for queries folded as (query, head of the KV group): [S, 1, Q * groups, C]."""
        if groups not in self._folded:
            s, _, q, c = self.mask.shape
            mask = self.mask if q == 1 else self.mask.unsqueeze(3).expand(s, 1, q, groups, c)
            self._folded[groups] = mask.reshape(s, 1, -1 if q > 1 else 1, c)
        return self._folded[groups]


@dataclass(frozen=True)
class FlatBatch:
    token_ids: torch.Tensor  # [N_padded]
    positions: torch.Tensor  # [N_padded]
    slots: torch.Tensor  # [N_padded], -1 for padding rows
    chunks: tuple[AttentionGroup, ...]  # the step's attention groups (decode rows, prefill chunks)
    sample_rows: torch.Tensor  # rows whose logits are wanted, in plan order (ScheduledChunk.num_logits_rows)
    num_tokens: int  # N before padding
    sample_argmax: torch.Tensor | None = None  # [samples] bool: the row needs only its argmax (None: no row)

    def to(self, device: torch.device) -> FlatBatch:
        """The batch on `device`: the runner decodes each plan on the host (where its sizes are read
        without waiting for the device) and moves the result in one pass of asynchronous copies."""
        if torch.device(device) == self.token_ids.device:
            return self
        return replace(
            self,
            token_ids=_to(self.token_ids, device),
            positions=_to(self.positions, device),
            slots=_to(self.slots, device),
            chunks=tuple(group.to(device) for group in self.chunks),
            sample_rows=_to(self.sample_rows, device),
            sample_argmax=_to(self.sample_argmax, device),
        )


def _to(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device, non_blocking=True)


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
        device: torch.device | str | None = None,
        scratch: bool = False,
    ):
        """`scratch`: one more block, past the `num_blocks` sequences may own, where the padding rows
        of a CUDA-graph step write (decode_graphs.py); its id is `scratch_block`."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks if scratch else None
        physical = num_blocks + scratch
        shape = (num_layers, 2, physical * block_size, kv_heads, head_dim)
        self.storage = torch.zeros(shape, dtype=dtype, device=device)
        # per layer and K/V, the views every step uses, made once (a decode step runs ~4 ops per layer
        # on them; taking the views per call cost as much as the ops)
        self._slots = [(self.storage[i, 0], self.storage[i, 1]) for i in range(num_layers)]
        self._blocks = [tuple(t.view(physical, -1) for t in pair) for pair in self._slots]
        # the CPU paged-attention kernel (kernels/cpu.py) when the runner enabled it: decode rows
        # then attend straight from the blocks, without `gather`
        self.kernel = None
        # decode rows attend from the blocks in place with FlexAttention (flex_decode.py) when set
        self.flex = False
        # where attention gathers a group's K and V blocks: kept from step to step and grown to the
        # largest gather, so that every layer writes the same (cache-hot) memory. A fresh tensor per
        # gather (tens of MB at 64 sequences x 512 context) came from mmap and page-faulted on every
        # write: a 64 x 512 decode step's attention took 40-68 ms with fresh tensors, 25-27 ms with these
        self._gathered = torch.empty((2, 0), dtype=dtype, device=device)
        self._views: tuple | None = None  # ((rows, seqs), row views and [S, Hkv, C, D] views of the buffers)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [N, kv_heads, head_dim] of the rows `slots` names (no padding rows), in place."""
        k_slots, v_slots = self._slots[layer]
        k_slots.index_copy_(0, slots, k)
        v_slots.index_copy_(0, slots, v)

    def slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` as [slots, kv_heads, head_dim] (views)."""
        return self._slots[layer]

    def blocks(self, layer: int, kv: int) -> torch.Tensor:
        """K (kv=0) or V (kv=1) of `layer` as [num_blocks, block_size * kv_heads * head_dim] (a view)."""
        return self._blocks[layer][kv]

    def gather(self, layer: int, block_index: torch.Tensor, seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks `block_index` names (`seqs` sequences' tables, sequence-major), copied
        into the cache's gather buffers, as [seqs, kv_heads, context, head_dim] views of them, valid
        until the next call (the views are made once per size, not per layer)."""
        rows = block_index.numel()
        if self._views is None or self._views[0] != (rows, seqs):
            self._views = ((rows, seqs), *self._make_views(rows, seqs))
        _, k_rows, v_rows, k, v = self._views
        k_blocks, v_blocks = self._blocks[layer]
        torch.index_select(k_blocks, 0, block_index, out=k_rows)
        torch.index_select(v_blocks, 0, block_index, out=v_rows)
        return k, v

    def reserve_gather(self, rows: int) -> torch.Tensor:
        """Grow the gather buffers to hold `rows` blocks now; returns them (CUDA graphs captured over
        them keep a reference: a larger gather later replaces the cache's)."""
        width = self.block_size * self.storage.shape[3] * self.storage.shape[4]
        if rows * width > self._gathered.shape[1]:
            self._gathered = self._gathered.new_empty((2, rows * width))
            self._views = None
        return self._gathered

    def _make_views(self, rows: int, seqs: int) -> tuple[torch.Tensor, ...]:
        kv_heads, head_dim = self.storage.shape[3:]
        width = self.block_size * kv_heads * head_dim
        if rows * width > self._gathered.shape[1]:
            self._gathered = self._gathered.new_empty((2, rows * width))
        k_rows, v_rows = (buffer[: rows * width].view(rows, width) for buffer in self._gathered)
        k, v = (t.view(seqs, -1, kv_heads, head_dim).transpose(1, 2) for t in (k_rows, v_rows))
        return k_rows, v_rows, k, v


class PagedAttention:
    """The attention backend of one step (`model.attention.AttentionBackend`): writes the step's K/V
    into the cache, then attends every query over its sequence's cached context."""

    def __init__(self, cache: PagedKVCache, batch: FlatBatch):
        self.cache, self.batch = cache, batch
        real = batch.num_tokens
        self._rows = None if real == batch.slots.numel() else torch.arange(real, device=batch.slots.device)
        self._slots = batch.slots[:real]
        self._decode = self.is_decode(batch)

    @staticmethod
    def decode_rows(batch: FlatBatch) -> int:
        """The sequences of a pure decode step (row i is sequence i, one query each; SP x TP's padding
        rows may follow), else 0."""
        groups = batch.chunks
        if len(groups) != 1 or groups[0].query_valid is not None or groups[0].rotation is not None:
            return 0
        rows = groups[0].query_rows
        return rows.shape[0] if rows.shape[1] == 1 and rows.shape[0] == batch.num_tokens else 0

    @staticmethod
    def is_decode(batch: FlatBatch) -> bool:
        """A pure decode step without padding rows: the lean path, decided once per step."""
        return 0 < PagedAttention.decode_rows(batch) == batch.slots.numel()

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [1, N, Hq, D], k/v: [1, N, Hkv, D] of this rank's head block -> [1, N, Hq, D]."""
        q, k, v = q[0], k[0], v[0]
        if self._rows is not None:  # padding rows (Ulysses) are not written
            k, v = k[: self.batch.num_tokens], v[: self.batch.num_tokens]
        self.cache.write(layer, self._slots, k, v)
        if self._decode:
            return self._attend_decode(layer, q, self.batch.chunks[0]).unsqueeze(0)
        out = torch.zeros_like(q)
        for group in self.batch.chunks:
            if self.cache.kernel is not None and group.query_pos is not None and group.rotation is None:
                kernel_rows(self.cache, layer, q, out, group)  # reads q's rows, writes out's, no gather
                continue
            if self.cache.flex and group.query_pos is not None and group.query_rows.shape[1] == 1:
                rows = group.query_rows[:, 0]  # a mixed step's decode rows: read in place, as a decode's
                plan = group.flex_mask(self.cache.block_size, self.cache.storage.shape[2])
                out[rows] = flex_decode(q[rows], *self.cache.slots(layer), plan, self.cache.block_size)
                continue
            attended = self._attend(layer, q[group.query_rows], group)  # [S, Q, Hq, D]
            if group.query_valid is None:
                out[group.query_rows.flatten()] = attended.flatten(0, 1)
            else:
                keep = group.valid_index
                out[group.query_rows.flatten()[keep]] = attended.flatten(0, 1)[keep]
        return out.unsqueeze(0)

    def _context(self, layer: int, seqs: int, group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's K and V gathered from the cache blocks: [S, Hkv, C, D] each."""
        return self.cache.gather(layer, group.block_index, seqs)

    def _attend_decode(self, layer: int, q: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
        """q: [S, Hq, D], one query per sequence -> [S, Hq, D]. The `groups` query heads of a KV head
        are the query axis of one SDPA row block ([S, Hkv, groups, D]); the mask [S, 1, 1, C] cuts each
        sequence at its length (and window)."""
        seqs, heads, d = q.shape
        if self.cache.kernel is not None and group.query_pos is not None:
            return kernel_decode(self.cache, layer, q, group.block_index, group.query_pos, group.window)
        if self.cache.flex and group.query_pos is not None:
            plan = group.flex_mask(self.cache.block_size, self.cache.storage.shape[2])
            return flex_decode(q, *self.cache.slots(layer), plan, self.cache.block_size)
        k, v = self._context(layer, seqs, group)
        folded = q.view(seqs, k.shape[1], -1, d)
        out = F.scaled_dot_product_attention(folded, k, v, attn_mask=group.bias(q.dtype))
        return out.reshape(seqs, heads, d)

    def _attend(self, layer: int, q: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
        """q: [S, Q, Hq, D] -> [S, Q, Hq, D] over the group's gathered context."""
        seqs, queries, heads, d = q.shape
        k, v = self._context(layer, seqs, group)
        kv_heads = k.shape[1]
        groups = heads // kv_heads
        if group.rotation is not None:
            return rotated_attention(q, k, v, group.mask, group.rotation)
        if group.from_start and queries > 1:  # query i reads keys 0..i of its own sequence: no mask
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k, v, is_causal=True, enable_gqa=groups > 1
            )  # [S, Hq, Q, D]; padding queries of a shorter chunk read only their chunk too
            return out.transpose(1, 2)
        # fold the `groups` query heads of each KV head into the query axis: [S, Hkv, Q * groups, D]
        folded = q.view(seqs, queries, kv_heads, groups, d).transpose(1, 2).reshape(seqs, kv_heads, -1, d)
        out = F.scaled_dot_product_attention(folded, k, v, attn_mask=group.folded_mask(groups))
        return out.view(seqs, kv_heads, queries, groups, d).transpose(1, 2).reshape(seqs, queries, heads, d)


def kernel_rows(
    cache: PagedKVCache, layer: int, q: torch.Tensor, out: torch.Tensor, group: AttentionGroup
) -> None:
    """The group's query rows of q [N, Hq, D] (a prefill chunk, or decode rows of a mixed step) attended
    by the CPU kernel straight from the cache blocks into the same rows of `out` (query rows in tiles
    of 16, each key block read once per tile: docs/serving.md "Paged KV cache and prefix caching")."""
    rows = group.query_rows
    if group.query_valid is not None:
        rows = rows.masked_fill(~group.query_valid, -1)
    seqs = rows.shape[0]
    k, v = cache.slots(layer)
    cache.kernel.paged_attention(
        q.contiguous(),
        k,
        v,
        group.block_index.view(seqs, -1),
        rows.contiguous(),
        group.query_pos.contiguous(),
        out,
        cache.block_size,
        group.window,
    )


def kernel_decode(
    cache: PagedKVCache,
    layer: int,
    q: torch.Tensor,
    block_index: torch.Tensor,
    positions: torch.Tensor,
    window: int = 0,
) -> torch.Tensor:
    """One query per sequence, q [S, Hq, D] at `positions` (S values), attended by the CPU kernel
    straight from the cache blocks (`block_index`: S equal tables, sequence-major) -> [S, Hq, D]."""
    seqs = q.shape[0]
    q = q.contiguous()
    out = torch.empty_like(q)
    k, v = cache.slots(layer)
    rows = torch.arange(seqs, device=q.device).view(seqs, 1)
    tables = block_index.view(seqs, -1)
    cache.kernel.paged_attention(
        q, k, v, tables, rows, positions.reshape(seqs, 1), out, cache.block_size, window
    )
    return out
