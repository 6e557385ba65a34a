"""The step's stream-group chunks, decoded on every rank: RoPE positions from their tags, and one
attention group per layout whose mask (and hogwild query rotation) comes from
`model.stream_mask.stream_visibility`, the function training uses too.

A stream group is one sequence in the cache whose tokens are the prompt followed by the streams'
tokens interleaved by timestep (`stream_mask.interleave`), so its context is one block table and its
shared prompt is allocated once. A token's slot follows its index in that order; its RoPE position and
stream come with the plan (`tags`) and are kept per slot (`BlockTables.tags`), so a later step reads
each cached key's (stream, position) without the plan resending the context. Slots below the prompt
length are the prompt (possibly blocks from the prefix cache, written by another sequence), so their
tags are implied, never read.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from shiftlm.model.stream_mask import PROMPT, stream_visibility
from shiftlm.serve.worker.paged_attention import AttentionGroup
from shiftlm.serve.worker.stream_attention import QueryRotation


def tag_tokens(
    tags: torch.Tensor,
    tagged: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    tables,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the tags [G * 2] of the `tagged` rows (a [N] mask) at their slots; return each row's
    stream (PROMPT for untagged rows) and RoPE position."""
    tags = tags.view(-1, 2)
    if tables.tags is None:
        tables.tags = tables.table.new_zeros(tables.num_blocks * block_size, 2)
    tables.tags[slots[tagged]] = tags
    streams = torch.full_like(positions, PROMPT)
    streams[tagged] = tags[:, 0]
    positions = positions.clone()
    positions[tagged] = tags[:, 1]
    return streams, positions


def stream_group(
    group: AttentionGroup,
    layout: int,
    row_streams: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    ends: torch.Tensor,
    prompt_lens: torch.Tensor,
    tables,
    block_size: int,
    inv_freq: torch.Tensor | None,
    window: int | None = None,
) -> AttentionGroup:
    """`group` (the chunks of one layout, padded as prefill chunks) with the visibility mask of
    `stream_visibility` over each chunk's whole context (`window`: the model's sliding window, which
    only isolated groups may have), and the query rotation for hogwild."""
    q_stream, q_pos = row_streams[group.query_rows], positions[group.query_rows]  # [S, Q]
    context = group.mask.shape[-1]
    index = torch.arange(context, device=rows.device)
    slots = tables.table[rows][:, index // block_size] * block_size + index % block_size  # [S, C]
    cached = tables.tags[slots]  # [S, C, 2]
    valid = index < ends.unsqueeze(1)
    in_prompt = index < prompt_lens.unsqueeze(1)
    k_stream = torch.where(in_prompt | ~valid, PROMPT, cached[..., 0])
    k_pos = torch.where(in_prompt, index, cached[..., 1])
    mask, shift = stream_visibility(layout, q_stream, q_pos, k_stream, k_pos, valid, window)
    rotation = None
    if shift is not None:
        if inv_freq is None:
            raise ValueError("hogwild stream groups need the model's RoPE frequencies (decode_plan inv_freq)")
        rotation = QueryRotation.build(shift, k_stream, inv_freq, torch.float32)
    return replace(
        group, mask=mask.unsqueeze(1), rotation=rotation, _folded={}, query_pos=None, from_start=False
    )
