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

from shiftlm.comm.wait import run_blocking
from shiftlm.mesh import Coords, Mesh, coords_of
from shiftlm.serve.paged_attention import FlatBatch
from shiftlm.serve.scheduler import Mode


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
    mine: torch.Tensor, batch: FlatBatch, mode: Mode, mesh: Mesh, vocab_per_tp: int
) -> torch.Tensor | None:
    """On the shift group's first rank: the [samples, padded_vocab] logits; None elsewhere."""
    group = mesh.shift
    blocks = [
        logits_block(batch, mode, coords_of(mesh.config, rank), mesh.config.sp, vocab_per_tp)
        for rank in group.ranks
    ]
    rows = max(block.sample_index.numel() for block in blocks)
    columns = max(block.vocab_len for block in blocks)
    padded = mine.new_zeros(rows, columns)
    padded[: mine.shape[0], : mine.shape[1]] = mine
    is_root = mesh.rank == group.ranks[0]
    parts = [torch.empty_like(padded) for _ in blocks] if is_root else None
    if group.size == 1:
        parts = [padded]
    else:
        run_blocking(dist.gather, padded, parts, dst=group.ranks[0], group=group.pg)
    if not is_root:
        return None
    logits = mine.new_empty(batch.sample_rows.numel(), vocab_per_tp * mesh.config.tp)
    for block, part in zip(blocks, parts):
        columns = slice(block.vocab_start, block.vocab_start + block.vocab_len)
        logits[block.sample_index, columns] = part[: block.sample_index.numel(), : block.vocab_len]
    return logits
