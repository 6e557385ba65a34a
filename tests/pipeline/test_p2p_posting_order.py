"""NCCL matches the point-to-point operations of two ranks in the order each side posts them (it
ignores tags), and a lone NCCL send waits until the peer's receive runs; gloo matches by tag. Code
that runs on both must therefore, for every pair of ranks, post the same sequence of operations on
both sides, with a send and a receive that must progress together started as one group
(`shiftlm.comm.p2p.exchange`). Recorded here on gloo ranks, through `shiftlm.comm.p2p`, for every
pipeline schedule (the bare executor at pp 2 and 4, and the trainer), ring attention (cp 2 and 4)
and the tied-embedding gradient sum.
"""

from __future__ import annotations

import pytest

from shiftlm.pipeline.schedules import SCHEDULES
from tests.train.conftest import tied_qwen2_model  # noqa: F401 - the fixture


def _recording(fn, *args):
    """Run fn(*args) on this rank; return (result, [group of (sender, receiver, tag, shape), ...])."""
    import torch.distributed as dist

    from shiftlm.comm import p2p

    posted = []
    post = p2p._post

    def recording(ops, group, shm=None):
        me = dist.get_rank()
        posted.append(
            [
                (me, peer, tag, tuple(t.shape)) if op == "send" else (peer, me, tag, tuple(t.shape))
                for op, t, peer, tag in ops
            ]
        )
        return post(ops, group, shm)

    p2p._post = recording
    try:
        return fn(*args), posted
    finally:
        p2p._post = post


def trained(overrides: list[str], log_dir: str):
    from tests.train.test_layouts import train_losses

    return _recording(train_losses, ["--train.steps=2", *overrides], log_dir)[1]


def executed(name: str, pp: int, microbatches: int, chunks: int | None):
    from tests.pipeline.test_executor import run_schedule

    return _recording(run_schedule, name, pp, microbatches, chunks)[1]


def order_mismatches(posted_by_rank: list[list[list[tuple]]]) -> dict:
    """Pairs whose two sides posted different sequences: (a, b) -> (a's sequence, b's sequence).

    Each side's sequence lists, per call that posted something with the other rank, the messages
    of that pair it started together (order inside one group does not matter)."""
    sequences: dict = {}
    for rank, groups in enumerate(posted_by_rank):
        for group in groups:
            by_peer: dict = {}
            for sender, receiver, tag, shape in group:
                peer = receiver if sender == rank else sender
                by_peer.setdefault(peer, []).append((sender, receiver, tag, shape))
            for peer, messages in by_peer.items():
                sequences.setdefault((rank, peer), []).append(tuple(sorted(messages)))
    pairs = {(min(a, b), max(a, b)) for a, b in sequences}
    return {
        (a, b): (sequences.get((a, b)), sequences.get((b, a)))
        for a, b in pairs
        if sequences.get((a, b)) != sequences.get((b, a))
    }


def test_the_check_catches_a_crossing_that_is_not_grouped_and_a_swapped_order():
    send_then_recv = [[(0, 1, 5, (2,))], [(1, 0, 6, (2,))]]
    crossing = [send_then_recv, [[(1, 0, 6, (2,))], [(0, 1, 5, (2,))]]]  # both send first
    assert order_mismatches(crossing)
    grouped = [[[(0, 1, 5, (2,)), (1, 0, 6, (2,))]], [[(1, 0, 6, (2,)), (0, 1, 5, (2,))]]]
    assert order_mismatches(grouped) == {}
    swapped = [[[(0, 1, 5, (2,))], [(0, 1, 6, (2,))]], [[(0, 1, 6, (2,))], [(0, 1, 5, (2,))]]]
    assert order_mismatches(swapped)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_pipeline_executor_posts_in_one_order_per_pair_at_pp2(ranks, name):
    posted = ranks.run(2, executed, name, 2, 4, None)
    assert sum(len(p) for p in posted) > 0
    assert order_mismatches(posted) == {}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_pipeline_executor_posts_in_one_order_per_pair_at_pp4(ranks, name):
    chunks = 3 if name == "interleaved_1f1b" else None
    posted = ranks.run(4, executed, name, 4, 8, chunks)
    assert sum(len(p) for p in posted) > 0
    assert order_mismatches(posted) == {}


@pytest.mark.parametrize(
    "overrides",
    [
        ["--parallel.pp=2", "--train.schedule=1f1b"],
        ["--parallel.pp=2", "--train.schedule=zb_v"],
        ["--parallel.pp=2", "--train.schedule=bitpipe"],
        ["--parallel.cp=2"],
    ],
    ids=["trainer-1f1b", "trainer-zb_v", "trainer-bitpipe", "ring-cp2"],
)
def test_training_posts_in_one_order_per_pair(ranks, tmp_path, overrides):
    posted = ranks.run(2, trained, overrides, str(tmp_path))
    assert sum(len(p) for p in posted) > 0
    assert order_mismatches(posted) == {}


def test_ring_attention_at_cp4_posts_in_one_order_per_pair(ranks, tmp_path):
    posted = ranks.run(4, trained, ["--parallel.cp=4"], str(tmp_path))
    assert sum(len(p) for p in posted) > 0
    assert order_mismatches(posted) == {}


def test_tied_embedding_gradient_sum_posts_in_one_order_per_pair(ranks, tmp_path, tied_qwen2_model):  # noqa: F811
    posted = ranks.run(2, trained, [tied_qwen2_model, "--parallel.pp=2"], str(tmp_path))
    grouped = [group for groups in posted for group in groups if len(group) > 1]
    assert grouped, "the tied embedding's gradient sum should post its crossing send and receive together"
    assert order_mismatches(posted) == {}
