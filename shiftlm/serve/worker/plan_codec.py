"""A step plan as one fixed-layout int64 tensor, and the step's batch tensors decoded from it.

Rank 0 encodes the scheduler's `StepPlan` (Python) once; the tensor is what travels to the other ranks
(one gloo broadcast of a fixed 1024 ints holding the header and the payload when it fits, a second for
the rest of a larger plan; instead of pickling the plan), and every rank, rank 0 included, decodes the same tensor with tensor ops only, so
no rank does Python work per token or per block of context:

    header   [step, mode (0 tp, 1 sp_tp), C chunks, N tokens, M new blocks, G tagged tokens]
    chunks   [C, 10]: row, start, length, sampled rows, all_logits, first_block, number of new blocks,
                     layout (0: causal; a stream group's otherwise), prompt length (stream groups),
                     argmax_only (the sampled row needs only its argmax: `logits.gather_logits`)
    tokens   [N]     the chunks' token ids, in plan order
    blocks   [M]     the chunks' new physical blocks, in plan order
    tags     [G, 2]  (stream, position) of every token of a stream-group chunk (serve/worker/stream_plan.py)

Block tables live on every rank as one tensor [rows, max blocks] (`BlockTables`) that the plan's deltas
update in place (vLLM's persistent batch); the scheduler names a sequence's row and only the blocks
appended since its previous chunk.
"""

from __future__ import annotations

import torch

from shiftlm.model.stream_mask import ISOLATED
from shiftlm.serve.plan import Mode, StepPlan
from shiftlm.serve.worker.paged_attention import AttentionGroup, FlatBatch
from shiftlm.serve.worker.stream_plan import stream_group, tag_tokens

HEADER = 6
CHUNK_FIELDS = 10
MODES = (Mode.TP, Mode.SP_TP)
STOP_CHUNKS = -1  # header[2] of the message that stops the workers


def encode_plan(plan: StepPlan) -> torch.Tensor:
    """The plan as one int64 tensor (layout in the module docstring)."""
    chunks, tokens, blocks, tags = [], [], [], []
    for c in plan.chunks:
        chunks += (c.row, c.start, len(c.token_ids), c.num_logits_rows * (not c.all_logits), c.all_logits)
        chunks += (c.first_block, len(c.new_blocks), c.layout, c.prompt_len, c.argmax_only and c.sample)
        tokens += c.token_ids
        blocks += c.new_blocks
        for stream, position in zip(c.streams, c.positions):
            tags += (stream, position)
    header = [plan.step, MODES.index(plan.mode), len(plan.chunks), len(tokens), len(blocks), len(tags) // 2]
    return torch.tensor(header + chunks + tokens + blocks + tags, dtype=torch.long, device="cpu")


def stop_message() -> torch.Tensor:
    return torch.tensor([0, 0, STOP_CHUNKS, 0, 0, 0], dtype=torch.long, device="cpu")


def payload_size(header: torch.Tensor) -> int:
    _, _, chunks, tokens, blocks, tagged = header.tolist()
    return chunks * CHUNK_FIELDS + tokens + blocks + 2 * tagged


class BlockTables:
    """Every running sequence's block table as rows of one tensor, updated in place from plan deltas.
    Entries past a sequence's own blocks hold stale but valid block ids: the attention mask hides them."""

    def __init__(
        self,
        max_blocks_per_seq: int,
        rows: int = 64,
        device: torch.device | str | None = None,
        num_blocks: int | None = None,
    ):
        """`max_blocks_per_seq`: the table's first width (a sequence of max_model_len tokens); a stream
        group, whose streams share one row, may hold more, and the table widens for it. `num_blocks`:
        the cache's blocks (default `max_blocks_per_seq`), which stream tags are indexed by."""
        self.table = torch.zeros(rows, max_blocks_per_seq, dtype=torch.long, device=device)
        self.num_blocks = num_blocks or max_blocks_per_seq
        self.tags: torch.Tensor | None = None  # [slots, 2] (stream, position) of stream-group tokens

    def update(self, rows: torch.Tensor, first: torch.Tensor, counts: torch.Tensor, blocks: torch.Tensor):
        """Write `blocks` (grouped per chunk, counts[i] of them) at table[rows[i], first[i] + j]."""
        height, width = self.table.shape
        if int(rows.max()) >= height:  # more rows than ever before: grow (metadata only)
            height = 2 * int(rows.max()) + 1
        if blocks.numel() and (needed := int((first + counts).max())) > width:
            width = max(needed, min(2 * width, self.num_blocks))  # a stream group's row: widen
        if (height, width) != tuple(self.table.shape):
            grown = self.table.new_zeros(height, width)
            grown[: self.table.shape[0], : self.table.shape[1]] = self.table
            self.table = grown
        if blocks.numel() == 0:
            return
        owner = torch.repeat_interleave(torch.arange(rows.numel(), device=rows.device), counts)
        index_in_chunk = (
            torch.arange(blocks.numel(), device=rows.device) - (torch.cumsum(counts, 0) - counts)[owner]
        )
        self.table[rows[owner], first[owner] + index_in_chunk] = blocks


def decode_plan(
    message: torch.Tensor,
    tables: BlockTables,
    block_size: int,
    pad_to_multiple: int = 1,
    sliding_window: int | None = None,
    inv_freq: torch.Tensor | None = None,
    fast_decode: bool = True,
) -> tuple[int, Mode, FlatBatch]:
    """Apply the plan's block deltas to `tables`; build the step's flat batch and attention groups
    (SP x TP steps padded to a multiple of `pad_to_multiple`, the sp size).
    `inv_freq` (the model's RoPE) is needed only by hogwild stream groups (query rotation).
    `fast_decode`: a plan of one-token causal chunks only (a decode step) takes `_decode_batch`, the
    same batch in a third of the host time; False: the general path (the tests compare the two)."""
    step, mode, num_chunks, num_tokens, num_blocks, _ = message[:HEADER].tolist()
    end_chunks = HEADER + num_chunks * CHUNK_FIELDS
    chunks = message[HEADER:end_chunks].view(num_chunks, CHUNK_FIELDS)
    padding = -num_tokens % pad_to_multiple if MODES[mode] is Mode.SP_TP else 0
    if fast_decode and num_chunks:
        fields = chunks.tolist()
        if all(f[2] == 1 and f[4] == 0 and f[7] == 0 for f in fields):
            args = (message, chunks, fields, end_chunks, num_tokens, num_blocks, tables, block_size)
            return step, MODES[mode], _decode_batch(*args, sliding_window, padding)
    rows, starts, lengths, sample, all_logits, first_block, new_counts, layouts, prompt_lens, argmax = (
        chunks.unbind(1)
    )
    token_ids = message[end_chunks : end_chunks + num_tokens]
    end_blocks = end_chunks + num_tokens + num_blocks
    tables.update(rows, first_block, new_counts, message[end_chunks + num_tokens : end_blocks])

    offsets = torch.cumsum(lengths, 0) - lengths  # first row of each chunk in the flat batch
    device = message.device  # the host (the runner decodes plans there and moves the batch: FlatBatch.to)
    owner = torch.repeat_interleave(torch.arange(num_chunks, device=device), lengths, output_size=num_tokens)
    in_chunk = torch.arange(num_tokens, device=device) - offsets[owner]
    positions = starts[owner] + in_chunk  # index in the sequence's table = position, but in stream groups
    seq_rows = rows[owner]
    slots = tables.table[seq_rows, positions // block_size] * block_size + positions % block_size
    wanted = all_logits[owner].bool() | (in_chunk >= lengths[owner] - sample[owner])
    sample_rows = wanted.nonzero().flatten()
    sample_argmax = argmax[owner[sample_rows]].bool()

    normal = layouts == 0
    decode = (lengths == 1) & normal
    prefill = (lengths > 1) & normal
    groups = []
    for which in (decode, prefill):
        if bool(which.any()):
            groups.append(_group(which, rows, starts, lengths, offsets, tables, block_size, sliding_window))
    if not bool(normal.all()):
        row_streams, positions = tag_tokens(
            message[end_blocks:], layouts[owner] > 0, slots, positions, tables, block_size
        )
        for layout in sorted(set(layouts[~normal].tolist())):
            which = layouts == layout
            chunk = _group(which, rows, starts, lengths, offsets, tables, block_size, None)
            ends, lens = (starts + lengths)[which], prompt_lens[which]
            args = (row_streams, positions, rows[which], ends, lens, tables, block_size, inv_freq)
            window = sliding_window if layout == ISOLATED else None  # others are refused (streams.py)
            groups.append(stream_group(chunk, layout, *args, window))
    # Ulysses splits the tokens evenly over sp: SP x TP steps pad to a multiple of it; full-TP steps,
    # where every rank takes every token, need no padding row
    if padding:
        token_ids = _pad(token_ids, padding, 0)
        positions = _pad(positions, padding, 0)
        slots = _pad(slots, padding, -1)
    batch = FlatBatch(token_ids, positions, slots, tuple(groups), sample_rows, num_tokens, sample_argmax)
    return step, MODES[mode], batch


def _decode_batch(
    message, chunks, fields, end_chunks, num_tokens, num_blocks, tables, block_size, window, padding
):
    """`decode_plan`'s batch of a decode step (every chunk one token of a causal sequence): the
    same tensors as the general path, from the chunk fields as Python ints (a handful of small
    tensors instead of ~40 ops over per-token index tensors: 0.18 -> 0.06 ms for one decode row,
    0.21 -> 0.11 ms for 64 here, bench/serve_host_overhead.py)."""
    rows_list, starts_list = [f[0] for f in fields], [f[1] for f in fields]
    if num_blocks or max(rows_list) >= tables.table.shape[0]:  # new blocks, or the table grows
        blocks = message[end_chunks + num_tokens : end_chunks + num_tokens + num_blocks]
        tables.update(chunks[:, 0], chunks[:, 5], chunks[:, 6], blocks)
    device = message.device
    rows = torch.tensor(rows_list, dtype=torch.long, device=device)
    positions = torch.tensor(starts_list, dtype=torch.long, device=device)
    table = tables.table
    slots = table[rows, positions // block_size] * block_size + positions % block_size
    sampled = [i for i, f in enumerate(fields) if f[3] > 0]
    sample_rows = torch.tensor(sampled, dtype=torch.long, device=device)
    sample_argmax = torch.tensor([fields[i][9] != 0 for i in sampled], dtype=torch.bool, device=device)
    # the decode group, as `_group` makes it for one-token chunks: query i is row i at its position
    count, context = len(fields), max(starts_list) + 1
    num_ctx_blocks = -(-context // block_size)
    query_pos = positions.unsqueeze(1)
    distance = query_pos.unsqueeze(-1) - torch.arange(num_ctx_blocks * block_size, device=device)
    mask = distance >= 0
    if window is not None:
        mask &= distance < window
    group = AttentionGroup(
        torch.arange(count, device=device).unsqueeze(1),
        None,
        mask.unsqueeze(1),
        table[rows, :num_ctx_blocks].flatten(),
        query_pos=query_pos,
        window=window or 0,
        from_start=max(starts_list) == 0 and (window is None or window >= 1),
    )
    token_ids = message[end_chunks : end_chunks + num_tokens]
    if padding:
        token_ids, positions, slots = (
            _pad(token_ids, padding, 0),
            _pad(positions, padding, 0),
            _pad(slots, padding, -1),
        )
    return FlatBatch(token_ids, positions, slots, (group,), sample_rows, num_tokens, sample_argmax)


def _pad(values: torch.Tensor, count: int, fill: int) -> torch.Tensor:
    return torch.cat((values, values.new_full((count,), fill)))


def _group(
    which: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    offsets: torch.Tensor,
    tables: BlockTables,
    block_size: int,
    sliding_window: int | None,
) -> AttentionGroup:
    """The chunks selected by `which` as one padded SDPA call: queries [S, Q], context [S, C]."""
    starts, lengths, offsets = starts[which], lengths[which], offsets[which]
    longest, context = int(lengths.max()), int((starts + lengths).max())
    num_blocks = -(-context // block_size)
    step = torch.arange(longest, device=rows.device)
    valid = step < lengths.unsqueeze(1)  # [S, Q]
    query_rows = offsets.unsqueeze(1) + torch.minimum(step, lengths.unsqueeze(1) - 1)
    query_pos = starts.unsqueeze(1) + torch.minimum(step, lengths.unsqueeze(1) - 1)
    key_pos = torch.arange(num_blocks * block_size, device=rows.device)
    distance = query_pos.unsqueeze(-1) - key_pos  # [S, Q, C]
    mask = distance >= 0  # causal, which also cuts each sequence at its own length
    if sliding_window is not None:
        mask &= distance < sliding_window
    mask = mask.unsqueeze(1)  # [S, 1, Q, C]
    block_index = tables.table[rows[which], :num_blocks].flatten()
    valid_or_none = None if bool(valid.all()) else valid
    from_start = bool((starts == 0).all()) and (sliding_window is None or sliding_window >= longest)
    return AttentionGroup(
        query_rows,
        valid_or_none,
        mask,
        block_index,
        query_pos=query_pos,
        window=sliding_window or 0,
        from_start=from_start,
    )
