"""The runner's block tables are as wide as the longest sequence, not as the cache (a GPU's cache has
~340k blocks: a table that wide costs GBs of host memory), and widen for a stream group's row."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftlm.model.stream_mask import HOGWILD
from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan
from shiftlm.serve.worker.plan_codec import BlockTables, decode_plan, encode_plan
from tests.model.test_stream_mask import POSITIONS, STREAMS
from tests.serve.test_host_sync import _tensors


def _plans() -> list[StepPlan]:
    """A sequence in row 0 (blocks 9, 2), then a hogwild stream group in row 1 whose 5 tokens of 2
    streams and later decode rows span 4 blocks, high ids among them (stream tags are kept per
    physical slot)."""
    streams = dict(layout=HOGWILD, prompt_len=2, streams=tuple(STREAMS), positions=tuple(POSITIONS))
    return [
        StepPlan(0, Mode.TP, (ScheduledChunk(0, (5, 17, 33), 0, (9, 2), True, row=0),)),
        StepPlan(
            1,
            Mode.TP,
            (
                ScheduledChunk(0, (11,), 3, (), True, row=0),
                ScheduledChunk(1, (7, 8, 9, 10, 11), 0, (15, 3, 14), True, row=1, sample_rows=2, **streams),
            ),
        ),
        StepPlan(
            2,
            Mode.TP,
            (
                ScheduledChunk(
                    1,
                    (12, 13),
                    5,
                    (13,),
                    True,
                    row=1,
                    first_block=3,
                    sample_rows=2,
                    **{**streams, "streams": (0, 1), "positions": (4, 3)},
                ),
            ),
        ),
    ]


def test_a_narrow_table_widens_for_a_stream_group_and_decodes_every_step_as_a_wide_one():
    wide, narrow = BlockTables(16), BlockTables(2, num_blocks=16)
    for plan in _plans():
        message = encode_plan(plan)
        want = list(_tensors(decode_plan(message, wide, 2, inv_freq=torch.ones(2))[2]))
        got = list(_tensors(decode_plan(message, narrow, 2, inv_freq=torch.ones(2))[2]))
        assert [path for path, _ in got] == [path for path, _ in want]
        for (path, a), (_, b) in zip(got, want):
            assert torch.equal(a, b), path
    # the stream group's row holds 4 blocks: the table widened to them, not to the cache's 16
    assert narrow.table.shape[1] == 4 and wide.table.shape[1] == 16
    assert narrow.tags.shape == wide.tags.shape == (16 * 2, 2)


def test_the_runners_table_is_as_wide_as_max_model_len(tmp_path):
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner
    from shiftlm.tools.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "tiny", "llama-gqa")
    mesh = Mesh(ParallelConfig(), device=torch.device("cpu"))
    runner = ModelRunner.load(path, mesh, num_blocks=1000, block_size=4, max_model_len=30)
    assert runner.tables.table.shape[1] == 8 and runner.tables.num_blocks == 1000
    short = ModelRunner.load(path, mesh, num_blocks=5, block_size=4, max_model_len=30)
    assert short.tables.table.shape[1] == 5  # never wider than the cache


def _same_batch(got, want) -> None:
    got_tensors, want_tensors = list(_tensors(got)), list(_tensors(want))
    assert [path for path, _ in got_tensors] == [path for path, _ in want_tensors]
    for (path, a), (_, b) in zip(got_tensors, want_tensors):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    assert (got.num_tokens, got.chunks[0].window, got.chunks[0].from_start) == (
        want.num_tokens,
        want.chunks[0].window,
        want.chunks[0].from_start,
    )


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.lists(st.tuples(st.integers(0, 9), st.booleans(), st.booleans()), min_size=1, max_size=6),
        min_size=1,
        max_size=5,
    ),
    block_size=st.sampled_from([2, 4]),
    window=st.sampled_from([None, 1, 3]),
    sp_tp=st.booleans(),
)
def test_a_decode_steps_fast_path_gives_the_general_paths_batch(steps, block_size, window, sp_tp):
    """Decode plans (one-token causal chunks: rows, positions, new blocks, sampled and argmax-only
    rows, a window, SP x TP padding, a table that grows) decode to the same tensors on both paths."""
    fast, general = BlockTables(4, rows=2), BlockTables(4, rows=2)
    length: dict[int, int] = {}
    for step, chunks in enumerate(steps):
        plan_chunks, used = [], set()
        for row, sample, argmax in chunks:
            if row in used:
                continue
            used.add(row)
            start = length.get(row, 0)
            new = (row * 5 + start // block_size,) if start % block_size == 0 else ()
            length[row] = start + 1
            first = start // block_size
            plan_chunks.append(
                ScheduledChunk(
                    row, (row + 3,), start, new, sample, row=row, first_block=first, argmax_only=argmax
                )
            )
        plan = StepPlan(step, Mode.SP_TP if sp_tp else Mode.TP, tuple(plan_chunks))
        message = encode_plan(plan)
        got = decode_plan(message, fast, block_size, 2, window)[2]
        want = decode_plan(message, general, block_size, 2, window, fast_decode=False)[2]
        _same_batch(got, want)
        assert torch.equal(fast.table, general.table)
