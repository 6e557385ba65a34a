"""NCCL matches point-to-point messages between two ranks in the order they are posted (it ignores
tags); gloo matches them by tag. Code that runs on NCCL must therefore post, for every (sender,
receiver) pair, its receives in the order the sender posts the sends. Recorded here on gloo ranks,
through `shiftlm.comm.p2p`, during two real training steps.

Ring attention (context parallelism) has that property. The pipeline executor does not: it posts
activation headers and receives ahead (RECV_AHEAD) and a gradient receive right after each forward,
so on NCCL messages would land in the wrong buffers; `shiftlm train` refuses pp > 1 on GPUs until
it does (the strict xfail turns into a failure, to be removed, once the executor is fixed).
"""

from __future__ import annotations

import pytest


def posted_p2p(overrides: list[str], log_dir: str) -> list[tuple[str, int, int, int, tuple]]:
    """(kind, sender, receiver, tag, shape) of every send and receive this rank posts, in order."""
    import torch.distributed as dist

    from shiftlm.comm import p2p
    from tests.train.test_layouts import train_losses

    posted = []
    start = p2p._start

    def recording(op, tensor, peer, group, tag):
        me = dist.get_rank()
        pair = (me, peer) if op == "send" else (peer, me)
        posted.append((op, *pair, tag, tuple(tensor.shape)))
        return start(op, tensor, peer, group, tag)

    p2p._start = recording
    try:
        train_losses(["--train.steps=2", *overrides], log_dir)
    finally:
        p2p._start = start
    return posted


def order_mismatches(posted_by_rank: list[list[tuple]]) -> dict:
    """Pairs whose receives were posted in another order than their sends: pair -> (sends, receives)."""
    sends: dict = {}
    receives: dict = {}
    for posted in posted_by_rank:
        for op, sender, receiver, tag, shape in posted:
            (sends if op == "send" else receives).setdefault((sender, receiver), []).append((tag, shape))
    return {
        pair: (sends.get(pair), receives.get(pair))
        for pair in set(sends) | set(receives)
        if sends.get(pair) != receives.get(pair)
    }


def test_ring_attention_posts_receives_in_the_senders_order(ranks, tmp_path):
    posted = ranks.run(2, posted_p2p, ["--parallel.cp=2"], str(tmp_path))
    assert sum(len(p) for p in posted) > 0
    assert order_mismatches(posted) == {}


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="the executor posts receives ahead of order")
@pytest.mark.parametrize("schedule", ["1f1b", "zb_v"])
def test_pipeline_executor_posts_receives_in_the_senders_order(ranks, tmp_path, schedule):
    posted = ranks.run(2, posted_p2p, ["--parallel.pp=2", f"--train.schedule={schedule}"], str(tmp_path))
    assert sum(len(p) for p in posted) > 0
    assert order_mismatches(posted) == {}
