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
    sample_rows: torch.Tensor, tokens: int, mode: Mode, coords: Coords, sp_size: int, vocab_per_tp: int
) -> LogitsBlock:
    """The block rank `coords` owns in a step of `tokens` rows (padding included) whose sampled rows
    are `sample_rows`; every rank can compute every rank's block. On the host's copy of the rows
    (`LogitsLayout`), the SP x TP split (a `nonzero`) reads nothing back from the device."""
    if mode is Mode.SP_TP:
        per_rank = tokens // sp_size
        local_rows = sample_rows - coords.sp * per_rank
        index = ((local_rows >= 0) & (local_rows < per_rank)).nonzero().flatten()
        return LogitsBlock(index, local_rows[index], coords.tp * vocab_per_tp, vocab_per_tp)
    start, length = full_tp_vocab_part(coords.sp, sp_size, vocab_per_tp)
    every_row = torch.arange(sample_rows.numel(), device=sample_rows.device)
    return LogitsBlock(every_row, sample_rows, coords.tp * vocab_per_tp + start, length)


@dataclass(frozen=True)
class LogitsLayout:
    """How a step's sampled logits come back to rank 0, worked out on the host from the plan before
    the step runs: every rank's block, which of its rows travel whole and which as their argmax only,
    and the gather's padded sizes. So neither the forward (`hidden_rows`) nor the gather reads the
    device (on a GPU each read would make the host wait for the step)."""

    blocks: tuple[LogitsBlock, ...]  # every shift-group rank's, in group order (host tensors)
    whole: tuple[torch.Tensor, ...]  # per block: its rows sent whole (positions in the block)
    tops: tuple[torch.Tensor, ...]  # per block: its rows sent as (max, argmax) (positions in the block)
    rows: int  # the gather's whole rows per rank (the most of any block)
    top_rows: int  # its argmax rows per rank
    columns: int  # its columns per whole row
    picked: torch.Tensor  # the sampled rows that need only their argmax
    samples: int  # the step's sampled rows
    me: int  # this rank's block


def logits_layout(
    sample_rows: torch.Tensor,
    sample_argmax: torch.Tensor | None,
    tokens: int,
    mode: Mode,
    mesh: Mesh,
    vocab_per_tp: int,
) -> LogitsLayout:
    """The layout of a step of `tokens` rows; `sample_rows` and `sample_argmax` on the host.

    Rows flagged `sample_argmax` (greedy, nothing else of the logits used) travel as each rank's
    (max, argmax) over its columns instead of the columns (unless no row is flagged)."""
    group = mesh.shift
    blocks = tuple(
        logits_block(sample_rows, tokens, mode, coords_of(mesh.config, rank), mesh.config.sp, vocab_per_tp)
        for rank in group.ranks
    )
    argmax = sample_argmax if sample_argmax is not None and bool(sample_argmax.any()) else None
    flags = [
        torch.zeros(block.sample_index.numel(), dtype=torch.bool, device=sample_rows.device)
        if argmax is None
        else argmax[block.sample_index]
        for block in blocks
    ]
    whole = tuple((~flag).nonzero().flatten() for flag in flags)
    tops = tuple(flag.nonzero().flatten() for flag in flags)
    picked = (
        argmax.nonzero().flatten()
        if argmax is not None
        else torch.zeros(0, dtype=torch.long, device=sample_rows.device)
    )
    return LogitsLayout(
        blocks=blocks,
        whole=whole,
        tops=tops,
        rows=max(index.numel() for index in whole),
        top_rows=max(index.numel() for index in tops),
        columns=max(block.vocab_len for block in blocks),
        picked=picked,
        samples=sample_rows.numel(),
        me=group.ranks.index(mesh.rank),
    )


def gather_logits(
    mine: torch.Tensor, layout: LogitsLayout, mesh: Mesh, vocab_per_tp: int, vocab_size: int
) -> torch.Tensor | None:
    """On the shift group's first rank: the [samples, padded_vocab] logits; None elsewhere.

    Whole rows go in one gather with the argmax rows (full rows first, then 16 bytes per argmax row);
    rank 0 picks each argmax row's best and returns the row with everything but that maximum at -inf,
    which is what the sampler's argmax reads. Every size comes from `layout`: no device read."""
    group, device = mesh.shift, mine.device
    me, rows, top_rows = layout.me, layout.rows, layout.top_rows
    full = mine.new_zeros(rows, layout.columns)
    if rows:  # every row of mine travels whole unless some row of the step is an argmax row
        sent = mine if top_rows == 0 else mine.index_select(0, _on(layout.whole[me], device))
        full[: layout.whole[me].numel(), : mine.shape[1]] = sent
    top = mine.new_zeros(top_rows, PACKED_ROW // mine.element_size())
    if top_rows:
        top[: layout.tops[me].numel()] = pack_max(
            mine.index_select(0, _on(layout.tops[me], device)), layout.blocks[me].vocab_start, vocab_size
        )
    padded = torch.cat((full.flatten(), top.flatten())) if top_rows else full.flatten()
    is_root = mesh.rank == group.ranks[0]
    parts = [torch.empty_like(padded) for _ in layout.blocks] if is_root else None
    if group.size == 1:
        parts = [padded]
    elif (local := shm.channel(group)) is not None:  # ranks of one host (comm/shm.py)
        parts = local.gather(padded, 0)
    else:
        run_blocking(dist.gather, padded, parts, dst=group.ranks[0], group=group.pg)
    if not is_root:
        return None
    logits = mine.new_empty(layout.samples, vocab_per_tp * mesh.config.tp)
    tops = []
    for block, whole, top_index, part in zip(layout.blocks, layout.whole, layout.tops, parts):
        if rows:
            columns = slice(block.vocab_start, block.vocab_start + block.vocab_len)
            index = _on(block.sample_index[whole], device)
            logits[index, columns] = part[: full.numel()].view(full.shape)[: whole.numel(), : block.vocab_len]
        if top_rows:
            index = _on(block.sample_index[top_index], device)
            tops.append((block.vocab_start, index, part[full.numel() :].view(top.shape)[: top_index.numel()]))
    if top_rows:
        picked = _on(layout.picked, device)
        value, column = best_of(tops, logits.shape[0], device)
        logits.index_fill_(0, picked, float("-inf"))
        logits[picked, column[picked]] = value[picked].to(logits.dtype)
    return logits


def _on(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host index tensor on `device` (an asynchronous copy; the same tensor on the CPU)."""
    return index.to(device, non_blocking=True)


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
