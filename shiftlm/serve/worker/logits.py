"""The sampled rows' logits, back to rank 0: every rank sends only the block it owns.

With V_T = padded_vocab / TP columns per TP shard (docs/design.md, "Process model": logits come back to rank 0):

- SP x TP: rank (sp, tp) holds the hidden states of token slice sp and LM-head shard tp, so it owns
  the sampled rows that fall in its slice x columns [tp*V_T, (tp+1)*V_T).
- Full TP: every rank holds all rows and the head view of part sp of shard tp (ceil(V_T/SP) columns),
  so it owns all sampled rows x columns tp*V_T + [sp*ceil(V_T/SP), ...).

Either way the blocks tile the [samples, padded_vocab] logits exactly once. Gloo's gather needs equal
shapes, so each block is zero-padded to the largest one, which every rank knows from the plan: about
samples*V/P floats per rank, instead of the samples*V of summing zero-filled full-size partials.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from shiftlm.comm import shm
from shiftlm.comm.wait import run_blocking
from shiftlm.mesh import Coords, Mesh, coords_of
from shiftlm.serve.plan import Mode
from shiftlm.serve.worker.paged_attention import FlatBatch


@dataclass(frozen=True)
class LogitsBlock:
    """Which logits one rank computes: sampled rows (plan order) x a column range of the padded vocab."""

    sample_index: torch.Tensor  # positions among the step's sampled rows
    hidden_rows: torch.Tensor  # the same rows in that rank's hidden states
    vocab_start: int
    vocab_len: int


def full_tp_vocab_part(sp: int, sp_size: int, vocab_per_tp: int) -> tuple[int, int]:
    """(start, length) within TP shard tp of the LM-head rows that rank (sp, tp) uses in full-TP mode."""
    part = -(-vocab_per_tp // sp_size)
    start = min(sp * part, vocab_per_tp)
    return start, min(part, vocab_per_tp - start)


def logits_block(
    batch: FlatBatch, mode: Mode, coords: Coords, sp_size: int, vocab_per_tp: int
) -> LogitsBlock:
    """The block rank `coords` owns in this step; every rank can compute every rank's block."""
    if mode is Mode.SP_TP:
        per_rank = batch.token_ids.numel() // sp_size
        local_rows = batch.sample_rows - coords.sp * per_rank
        index = ((local_rows >= 0) & (local_rows < per_rank)).nonzero().flatten()
        return LogitsBlock(index, local_rows[index], coords.tp * vocab_per_tp, vocab_per_tp)
    start, length = full_tp_vocab_part(coords.sp, sp_size, vocab_per_tp)
    every_row = torch.arange(batch.sample_rows.numel(), device=batch.sample_rows.device)
    return LogitsBlock(every_row, batch.sample_rows, coords.tp * vocab_per_tp + start, length)


def gather_logits(
    mine: torch.Tensor, batch: FlatBatch, mode: Mode, mesh: Mesh, vocab_per_tp: int, vocab_size: int
) -> torch.Tensor | None:
    """On the shift group's first rank: the [samples, padded_vocab] logits; None elsewhere.

    Rows flagged `batch.sample_argmax` (greedy, nothing else of the logits used) travel as each rank's
    (max, argmax) over its columns instead of the columns: rank 0 picks the best and returns the row
    with everything but that maximum at -inf, which is what the sampler's argmax reads. Both kinds go
    in one gather (full rows first, then 16 bytes per argmax row)."""
    group = mesh.shift
    blocks = [
        logits_block(batch, mode, coords_of(mesh.config, rank), mesh.config.sp, vocab_per_tp)
        for rank in group.ranks
    ]
    samples = batch.sample_rows.numel()
    argmax = batch.sample_argmax
    if argmax is None or not bool(argmax.any()):
        argmax = None  # every row whole (sampled steps, one-rank-per-row layouts): the gather as before
    splits = [None if argmax is None else argmax[block.sample_index] for block in blocks]
    tops_per_block = [0 if split is None else int(split.sum()) for split in splits]
    rows = max(block.sample_index.numel() - n for block, n in zip(blocks, tops_per_block))
    top_rows = max(tops_per_block)
    columns = max(block.vocab_len for block in blocks)
    me = group.ranks.index(mesh.rank)
    full = mine.new_zeros(rows, columns)
    if rows:
        mine_full = mine if splits[me] is None else mine[~splits[me]]
        full[: mine_full.shape[0], : mine.shape[1]] = mine_full
    top = mine.new_zeros(top_rows, PACKED_ROW // mine.element_size())
    if top_rows:
        top[: tops_per_block[me]] = pack_max(mine[splits[me]], blocks[me].vocab_start, vocab_size)
    padded = torch.cat((full.flatten(), top.flatten())) if top_rows else full.flatten()
    is_root = mesh.rank == group.ranks[0]
    parts = [torch.empty_like(padded) for _ in blocks] if is_root else None
    if group.size == 1:
        parts = [padded]
    elif (local := shm.channel(group)) is not None:  # ranks of one host (comm/shm.py)
        parts = local.gather(padded, 0)
    else:
        run_blocking(dist.gather, padded, parts, dst=group.ranks[0], group=group.pg)
    if not is_root:
        return None
    logits = mine.new_empty(samples, vocab_per_tp * mesh.config.tp)
    tops = []
    for block, split, part in zip(blocks, splits, parts):
        if rows:
            columns = slice(block.vocab_start, block.vocab_start + block.vocab_len)
            index = block.sample_index if split is None else block.sample_index[~split]
            logits[index, columns] = part[: full.numel()].view(full.shape)[: index.numel(), : block.vocab_len]
        if top_rows:
            index = block.sample_index[split]
            tops.append((block.vocab_start, index, part[full.numel() :].view(top.shape)[: index.numel()]))
    if top_rows:
        picked = argmax.nonzero().flatten()
        value, column = best_of(tops, samples, mine.device)
        logits.index_fill_(0, picked, float("-inf"))
        logits[picked, column[picked]] = value[picked].to(logits.dtype)
    return logits


PACKED_ROW = 16  # bytes of one argmax row: its max as float64 and the column as int64


def pack_max(block: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """[rows, PACKED_ROW bytes in block's dtype]: each row's (max, global column of the first max)
    over the real vocabulary (padding columns of the last shard never win)."""
    real = max(0, min(block.shape[1], vocab_size - vocab_start))
    if real < block.shape[1]:
        block = block[:, :real]
    if real == 0:  # an empty block: a max that never beats a real column
        value = block.new_full((block.shape[0],), float("-inf"), dtype=torch.float64)
        column = torch.full_like(value, vocab_start, dtype=torch.long)
    else:
        # torch.max(dim) picks as the sampler's torch.argmax does (the first maximum, NaN the largest;
        # test_greedy_argmax checks it) at a third of argmax's time here (54 vs 160 us at 32 x 4000)
        value, column = block.max(dim=1)
        value, column = value.double(), column + vocab_start
    packed = torch.stack((value, column.view(torch.float64)), dim=1)
    return packed.view(torch.uint8).view(block.dtype)


def best_of(
    tops: list[tuple[int, torch.Tensor, torch.Tensor]], samples: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(value, column) per sampled row from every rank's (vocab_start, sample index, packed maxima):
    as torch.argmax over the whole row: the first maximum wins, NaN counts as the largest."""
    value = torch.full((samples,), float("-inf"), dtype=torch.float64, device=device)
    column = torch.zeros(samples, dtype=torch.long, device=device)
    seen = torch.zeros(samples, dtype=torch.bool, device=device)
    for _, index, packed in sorted(tops, key=lambda top: top[0]):  # ascending columns
        pairs = packed.clone().view(torch.uint8).view(torch.float64).view(-1, 2)
        mine_value, mine_column = pairs[:, 0], pairs[:, 1].view(torch.long)
        best = value[index]
        wins = ~seen[index] | (~best.isnan() & ((mine_value > best) | mine_value.isnan()))
        value[index] = torch.where(wins, mine_value, best)
        column[index] = torch.where(wins, mine_column, column[index])
        seen[index] = True
    return value, column
