"""A plan reaches every rank whole, whether it fits the first broadcast or needs the second."""

from __future__ import annotations

import torch

from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan
from shiftlm.serve.worker.plan_codec import encode_plan
from shiftlm.serve.worker.runner import FIRST_MESSAGE
from shiftlm.tools.tiny import make_tiny_checkpoint


def _plans() -> list[StepPlan]:
    """A decode step (fits), a plan exactly at the first broadcast's size, and a long prefill (two)."""
    decode = StepPlan(3, Mode.TP, tuple(ScheduledChunk(i, (7 + i,), 5, (), True, row=i) for i in range(4)))
    overhead = encode_plan(StepPlan(0, Mode.TP, (ScheduledChunk(0, (1,), 0, (0,), True, row=0),))).numel() - 1
    exact = StepPlan(
        4, Mode.SP_TP, (ScheduledChunk(0, (9,) * (FIRST_MESSAGE - overhead), 0, (0,), True, row=0),)
    )
    long = StepPlan(
        5, Mode.SP_TP, (ScheduledChunk(1, tuple(range(3 * FIRST_MESSAGE)), 0, (1, 2), True, row=1),)
    )
    return [decode, exact, long]


def receive_plans_on_ranks(model_dir: str) -> list[list[int]] | None:
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    mesh = Mesh(ParallelConfig(tp=1, sp=2))
    runner = ModelRunner.load(model_dir, mesh, num_blocks=8, block_size=4)
    if mesh.rank == 0:
        for plan in _plans():
            runner._send(encode_plan(plan))
        runner.stop_workers()
        return None
    received = []
    while (message := runner._receive()) is not None:
        received.append(message.tolist())
    return received


def test_plans_of_every_size_arrive_whole_on_the_other_rank(ranks, tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama-gqa")
    received = ranks.run(2, receive_plans_on_ranks, str(model_dir))[1]
    sent = [encode_plan(plan).tolist() for plan in _plans()]
    assert [len(m) for m in sent][1] == FIRST_MESSAGE  # the boundary case is really at the boundary
    assert len(sent[2]) > FIRST_MESSAGE
    assert received == sent
    assert torch.tensor(received[0]).numel() < FIRST_MESSAGE
