"""How serving ranks wait: one core per local rank, and collectives polled before sleeping (opt-in)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from shiftlm.comm.wait import run_blocking, set_spin_wait, spin_wait_seconds
from shiftlm.serve.worker.start import pin_local_rank
from shiftlm.tools.tiny import make_tiny_checkpoint
from tests.serve.test_plan_broadcast import _plans, receive_plans_on_ranks


def test_local_rank_r_is_pinned_to_the_rth_allowed_core_only_when_every_rank_has_one():
    allowed = os.sched_getaffinity(0)
    try:
        assert pin_local_rank(0, len(allowed) + 1) is None  # fewer cores than ranks: left alone
        assert os.sched_getaffinity(0) == allowed
        assert pin_local_rank(0, 1) is None  # one rank: taskset decides
        if len(allowed) >= 2:
            core = pin_local_rank(1, 2)
            assert core == sorted(allowed)[1] and os.sched_getaffinity(0) == {core}
    finally:
        os.sched_setaffinity(0, allowed)


def collectives_with_spin_wait(seconds: float, late_rank: int) -> list[list[float]]:
    """All-reduce, all-to-all (comm.ops), gather and broadcast (run_blocking) with polling on;
    `late_rank` enters every collective 50 ms late, so its peer's poll runs out and it sleeps."""
    from shiftlm.comm.group import CommGroup
    from shiftlm.comm.ops import all_reduce, all_to_all

    rank = dist.get_rank()
    group = CommGroup("world", (0, 1), dist.group.WORLD, rank)
    set_spin_wait(seconds)
    try:
        out = []
        for _ in range(2):
            if rank == late_rank:
                time.sleep(0.05)
            out.append(all_reduce(torch.tensor([1.0, 2.0]) * (rank + 1), group).tolist())
            out.append(all_to_all(torch.arange(4.0) + 10 * rank, group, 0, 0).tolist())
            mine = torch.full((2,), float(rank))
            parts = [torch.empty(2) for _ in range(2)] if rank == 0 else None
            run_blocking(dist.gather, mine, parts, dst=0)
            out.append(torch.cat(parts).tolist() if rank == 0 else [])
            message = torch.tensor([7.0, 8.0]) if rank == 0 else torch.zeros(2)
            run_blocking(dist.broadcast, message, src=0)
            out.append(message.tolist())
        return out
    finally:
        set_spin_wait(0.0)


@pytest.mark.parametrize("late_rank", [0, 1])
def test_polled_collectives_give_what_blocking_ones_give(ranks, late_rank):
    blocking = ranks.run(2, collectives_with_spin_wait, 0.0, late_rank)
    polled = ranks.run(2, collectives_with_spin_wait, 0.002, late_rank)
    assert polled == blocking
    assert blocking[0][:4] == [[3.0, 6.0], [0.0, 1.0, 10.0, 11.0], [0.0, 0.0, 1.0, 1.0], [7.0, 8.0]]
    assert blocking[1][1] == [2.0, 3.0, 12.0, 13.0]


def receive_plans_polling(model_dir: str):
    set_spin_wait(0.01)
    try:
        return receive_plans_on_ranks(model_dir)
    finally:
        set_spin_wait(0.0)


def test_plans_arrive_whole_with_polling_on(ranks, tmp_path):
    from shiftlm.serve.worker.plan_codec import encode_plan

    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama-gqa")
    received = ranks.run(2, receive_plans_polling, str(model_dir))[1]
    assert received == [encode_plan(plan).tolist() for plan in _plans()]


def test_spin_wait_is_off_by_default_and_refuses_negative_seconds():
    assert spin_wait_seconds() == 0.0
    with pytest.raises(ValueError, match="must be >= 0"):
        set_spin_wait(-1)
