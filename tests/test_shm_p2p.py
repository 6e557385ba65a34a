"""Point-to-point through shared memory between the ranks of one host (comm/shm_p2p.py): every byte
arrives, in posting order, for messages from empty to several times a ring; two ranks sending each
other more than a ring holds make progress instead of deadlocking; a receive posted in the wrong order
is named; a peer that exited or never sends is named instead of a hang."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from shiftlm.comm.group import CommGroup

kernels = pytest.importorskip("shiftlm.kernels.cpu")
needs_kernels = pytest.mark.skipif(kernels.load() is None, reason="the CPU kernels do not build here")


def _payload(src: int, dst: int, k: int, numel: int, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(numel, dtype=torch.float64) * (k + 1) + 1000 * src + 10 * dst).to(dtype)


def _traffic(name: str) -> dict:
    """Every rank sends every other rank messages of several sizes (one larger than a ring), posting
    all its sends before any receive, through `comm.p2p` with gloo's point-to-point made to raise."""
    import torch.distributed as dist

    from shiftlm.comm import p2p, shm_p2p

    rank, world = dist.get_rank(), dist.get_world_size()
    group = CommGroup(name, tuple(range(world)), dist.new_group(list(range(world))), rank)
    channel = shm_p2p.enable(group, kernels.load())
    assert channel is not None and shm_p2p.channel(group) is channel
    sizes = [0, 1, 777, 3 * channel.capacity // 4 + 5, 2 * channel.capacity + 13]  # bytes / 4
    saved = dist.isend, dist.irecv
    dist.isend = dist.irecv = lambda *a, **k: (_ for _ in ()).throw(AssertionError("gloo p2p"))
    try:
        sends = [
            p2p.isend(_payload(rank, peer, k, n, dtype), peer, group, tag=k)
            for peer in range(world)
            if peer != rank
            for k, (n, dtype) in enumerate((n, d) for n in sizes for d in (torch.float32, torch.int64))
        ]
        got = {}
        for peer in range(world):
            if peer == rank:
                continue
            for k, (n, dtype) in enumerate((n, d) for n in sizes for d in (torch.float32, torch.int64)):
                buffer = torch.empty(n, dtype=dtype)
                p2p.irecv(buffer, peer, group, tag=k).wait()
                got[(peer, k)] = torch.equal(buffer, _payload(peer, rank, k, n, dtype))
        for work in sends:
            work.wait()
        return got
    finally:
        dist.isend, dist.irecv = saved


@needs_kernels
@pytest.mark.parametrize("world", [2, 3])
def test_every_message_arrives_whole_and_in_order(ranks, world):
    results = ranks.run(world, _traffic, f"traffic{world}")
    for rank, got in enumerate(results):
        assert got and all(got.values()), (rank, [key for key, ok in got.items() if not ok])


def _out_of_order() -> str:
    import torch.distributed as dist

    from shiftlm.comm import shm_p2p

    rank = dist.get_rank()
    group = CommGroup("misordered", (0, 1), dist.new_group([0, 1]), rank)
    channel = shm_p2p.enable(group, kernels.load())
    try:
        if rank == 0:
            first, second = channel.isend(torch.ones(4), 1, tag=1), channel.isend(torch.ones(8), 1, tag=2)
            first.wait(), second.wait()
            return ""
        try:
            channel.irecv(torch.empty(8), 0, tag=2).wait()
        except RuntimeError as err:
            return str(err)
        return "no error"
    finally:
        shm_p2p.disable_all()


@needs_kernels
def test_a_receive_posted_out_of_order_is_named(ranks):
    message = ranks.run(2, _out_of_order)[1]
    assert "sent a message with tag 1 (16 bytes)" in message
    assert "expects tag 2 (32 bytes)" in message and "different orders" in message


def _channel(tmp_path, rank: int, timeout_s: float = 0.0, create: bool = True):
    from shiftlm.comm.shm import WaitPolicy
    from shiftlm.comm.shm_p2p import P2PChannel

    group = CommGroup("pp", (0, 1), None, rank)
    policy = WaitPolicy(spin_s=1e-5, yield_s=1e-4, timeout_s=timeout_s)
    return P2PChannel(group, tmp_path / "seg", kernels.load(), policy, 1 << 20, create=create)


def _exit_at_once() -> None:
    os._exit(0)


@needs_kernels
def test_a_peer_that_exited_is_named_not_waited_for(tmp_path):
    peer = mp.get_context("spawn").Process(target=_exit_at_once)
    peer.start()
    peer.join()
    channel = _channel(tmp_path, 0)
    other = _channel(tmp_path, 1, create=False)
    other.segment[64 + 8 : 64 + 16].view(torch.int64)[0] = peer.pid  # rank 1's pid: an exited process
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"local rank 1 \(pid {peer.pid}\) exited"):
        channel.irecv(torch.empty(4), 1).wait()
    assert time.monotonic() - start < 5


@needs_kernels
def test_a_peer_that_never_sends_times_out(tmp_path):
    channel = _channel(tmp_path, 0, timeout_s=0.2)
    _channel(tmp_path, 1, create=False)  # alive (our own pid), silent
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="no message from local ranks within 0.2"):
        channel.irecv(torch.empty(4), 1).wait()
    assert 0.2 <= time.monotonic() - start < 5


@needs_kernels
def test_a_send_larger_than_the_ring_waits_for_the_reader(tmp_path):
    """In one process: rank 0's send of 2.5 rings is written as rank 1 reads, and its wait returns
    once rank 1 has taken the rest."""
    sender, receiver = _channel(tmp_path, 0), _channel(tmp_path, 1, create=False)
    data = torch.arange(5 * (1 << 20) // 8, dtype=torch.float32)  # 2.5 MiB through a 1 MiB ring
    work = sender.isend(data, 1, tag=7)
    assert not work.is_completed()
    out = torch.empty_like(data)
    incoming = receiver.irecv(out, 0, tag=7)
    while not incoming.is_completed():
        sender.poll()
    assert work.is_completed() and torch.equal(out, data)
