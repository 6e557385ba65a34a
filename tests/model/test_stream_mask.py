"""The stream visibility on a case drawn by hand: a prompt of 2 tokens (P0 P1), stream a of 2 tokens
(a0 a1) and stream b of 1 (b0), in cache order P0 P1 a0 b0 a1. Serving (decode_plan over the paged
cache) and training (train/streams.py) both get exactly these matrices from the one function."""

from __future__ import annotations

import torch

from shiftlm.model.stream_mask import (
    HOGWILD,
    ISOLATED,
    TIMESTEP,
    interleave,
    sample_visibility,
    stream_visibility,
)
from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan
from shiftlm.serve.worker.plan_codec import BlockTables, decode_plan, encode_plan

# fmt: off
#                 P0 P1 a0 b0 a1
TIMESTEP_MASK = [
    [1, 0, 0, 0, 0],  # P0
    [1, 1, 0, 0, 0],  # P1
    [1, 1, 1, 0, 0],  # a0: prompt, itself
    [1, 1, 0, 1, 0],  # b0: prompt, itself (a0 is the same timestep)
    [1, 1, 1, 1, 1],
]  # a1: prompt, timestep 0 of every stream, itself
ISOLATED_MASK = [row[:] for row in TIMESTEP_MASK]
ISOLATED_MASK[4] = [1, 1, 1, 0, 1]  # a1 does not see b0
# hogwild: a1's view is P0 P1 b0 a0 a1 (b's block before its own), so its query is rotated one
# position further for the prompt and for b0; nothing else moves
HOGWILD_SHIFT = [[0] * 5, [0] * 5, [0] * 5, [0] * 5, [1, 1, 0, 1, 0]]
STREAMS, POSITIONS = [-1, -1, 0, 1, 0], [0, 1, 2, 2, 3]  # stream token t sits at prompt_len + t
# fmt: on


def tags():
    return torch.tensor(STREAMS), torch.tensor(POSITIONS)


def test_interleave_puts_each_timestep_of_every_stream_after_the_prompt():
    assert interleave(2, [2, 1]) == (STREAMS, POSITIONS)


def test_the_masks_and_the_hogwild_shift_are_the_hand_drawn_ones():
    s, p = tags()
    for layout, expected in ((TIMESTEP, TIMESTEP_MASK), (ISOLATED, ISOLATED_MASK), (HOGWILD, TIMESTEP_MASK)):
        mask, shift = stream_visibility(layout, s, p, s, p)
        assert mask.int().tolist() == expected
        assert (shift is None) == (layout != HOGWILD)
    _, shift = stream_visibility(HOGWILD, s, p, s, p)
    assert shift.tolist() == HOGWILD_SHIFT
    assert sample_visibility("timestep", 2, [2, 1])[2].int().tolist() == TIMESTEP_MASK


def serving_mask(layout: int) -> torch.Tensor:
    """The mask decode_plan builds for a group chunk of the hand-drawn tokens (block size 2)."""
    chunk = ScheduledChunk(
        0,
        (7, 8, 9, 10, 11),
        0,
        (3, 1, 4),
        True,
        layout=layout,
        prompt_len=2,
        streams=tuple(STREAMS),
        positions=tuple(POSITIONS),
        sample_rows=2,
    )
    _, _, batch = decode_plan(
        encode_plan(StepPlan(0, Mode.TP, (chunk,))), BlockTables(8), 2, inv_freq=torch.ones(2)
    )
    (group,) = batch.chunks
    assert batch.positions.tolist() == POSITIONS
    assert batch.sample_rows.tolist() == [3, 4]  # the last timestep's rows
    return group.mask[0, 0]


def test_serving_reads_the_same_mask_from_the_paged_cache():
    for layout, expected in ((TIMESTEP, TIMESTEP_MASK), (ISOLATED, ISOLATED_MASK), (HOGWILD, TIMESTEP_MASK)):
        mask = serving_mask(layout)
        assert mask[:, :5].int().tolist() == expected
        assert not mask[:, 5:].any()  # the rest of the last block is not context


def test_training_builds_the_same_mask_and_positions_for_a_sample():
    from shiftlm.train.streams import stream_context, stream_sample

    sample = stream_sample([7, 8], [[9, 11], [10]], seq_len=6)  # one padding token
    assert sample[:5, 0].tolist() == [7, 8, 9, 10, 11]
    assert sample[:5, 1].tolist() == [-100, -100, 11, -100, -100]  # a0 -> a1; nothing else has a next
    context = stream_context(sample[None, :, 2:])
    assert context.positions[0, :5].tolist() == POSITIONS
    mask = context.backend.mask[0, 0]
    assert mask[:5, :5].int().tolist() == TIMESTEP_MASK
    assert not mask[:5, 5].any()  # no real token reads the padding
