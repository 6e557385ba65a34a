"""The runner's block tables are as wide as the longest sequence, not as the cache (a GPU's cache has
~340k blocks: a table that wide costs GBs of host memory), and widen for a stream group's row."""

from __future__ import annotations

import torch

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
