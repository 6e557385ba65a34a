"""Shared-memory collectives among the ranks of one host (comm/shm.py): the same results as gloo's
(bit for bit on 2 ranks, where a sum has one order), the same bits on every rank, tensors larger than
a slot in chunks, and a peer that exited or never comes named in an error instead of a hang."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from shiftlm.comm.group import CommGroup

kernels = pytest.importorskip("shiftlm.kernels.cpu")
needs_kernels = pytest.mark.skipif(kernels.load() is None, reason="the CPU kernels do not build here")


def _collectives(capacity: int) -> dict:
    import torch.distributed as dist

    from shiftlm.comm import ops, shm

    rank, world = dist.get_rank(), dist.get_world_size()
    group = CommGroup("tp", tuple(range(world)), dist.new_group(list(range(world))), rank)
    local = shm.enable(group, kernels.load(), capacity=capacity)
    assert local is not None and shm.channel(group) is local
    out = {}
    for n in (0, 1, 513, 3 * capacity // 4 + 7):  # the last: several chunks
        torch.manual_seed(rank)
        x = torch.randn(n)
        mine, theirs = local.all_reduce_(x.clone()), x.clone()
        dist.all_reduce(theirs, group=group.pg)
        out[f"sum {n}"] = (mine, theirs)
    x = torch.arange(7, dtype=torch.float64)
    out["ops.all_reduce"] = (ops.all_reduce(x * (rank + 1), group), x * sum(range(1, world + 1)))
    src = world - 1
    b = torch.full((capacity // 2 + 3,), float(rank), dtype=torch.float32)
    out["broadcast"] = (local.broadcast_(b, src), torch.full_like(b, float(src)))
    parts = local.gather(torch.full((5,), rank, dtype=torch.int64), 0)
    if rank == 0:
        out["gather"] = (torch.stack(parts), torch.arange(world).repeat_interleave(5).view(world, 5))
    else:
        assert parts is None
    pieces = [torch.full((2, 3), 10.0 * rank + j) for j in range(world)]  # piece j goes to rank j
    got = torch.stack(local.all_to_all(pieces))
    out["all_to_all"] = (got, torch.stack([torch.full((2, 3), 10.0 * j + rank) for j in range(world)]))
    out["ops.all_gather"] = (ops.all_gather(torch.tensor([rank]), group, 0), torch.arange(world))
    return out


@needs_kernels
@pytest.mark.parametrize("world", [2, 3])
def test_shm_collectives_equal_gloo(ranks, world):
    capacity = 4096
    results = ranks.run(world, _collectives, capacity)
    for rank, out in enumerate(results):
        for name, (got, want) in out.items():
            if world == 2 or not name.startswith("sum"):
                assert torch.equal(got, want), (rank, name)
            else:  # gloo's sum of three has its own order
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for name in results[0]:  # every rank holds the same bits (of what all of them receive alike)
        if name not in ("gather", "all_to_all"):
            assert all(torch.equal(out[name][0], results[0][name][0]) for out in results), name


def _channel(tmp_path, rank: int, world: int, timeout_s: float = 0.0, create: bool = True):
    from shiftlm.comm.shm import ShmChannel, WaitPolicy

    group = CommGroup("tp", tuple(range(world)), None, rank)
    policy = WaitPolicy(spin_s=1e-5, yield_s=1e-4, timeout_s=timeout_s)
    return ShmChannel(group, tmp_path / "seg", kernels.load(), policy, 4096, create=create)


def _exit_at_once() -> None:
    os._exit(0)


@needs_kernels
@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_a_peer_that_exited_is_named_not_waited_for(tmp_path, reaped):
    """Reaped or not: a worker rank that died while rank 0, its parent, waits in a collective is a
    zombie until rank 0 reaps it, and `kill(pid, 0)` still succeeds for one (rank 0 waited for ever)."""
    peer = mp.get_context("spawn").Process(target=_exit_at_once)
    peer.start()
    if reaped:
        peer.join()
    else:
        os.waitid(os.P_PID, peer.pid, os.WEXITED | os.WNOWAIT)  # exited, left unreaped
    channel = _channel(tmp_path, 0, 2)
    other = _channel(tmp_path, 1, 2, create=False)
    kernels.load().shm_init(other.segment, 1, 2, 4096)
    other.segment[64 + 8 : 64 + 16].view(torch.int64)[0] = peer.pid  # rank 1's pid: an exited process
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"local rank 1 \(pid {peer.pid}\) exited"):
        channel.all_reduce_(torch.ones(4))
    assert time.monotonic() - start < 5


@needs_kernels
def test_a_peer_that_never_comes_times_out(tmp_path):
    channel = _channel(tmp_path, 0, 2, timeout_s=0.2)
    kernels.load().shm_init(_channel(tmp_path, 1, 2, create=False).segment, 1, 2, 4096)  # alive: our pid
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="local rank 1 did not arrive within 0.2"):
        channel.broadcast_(torch.ones(4), 0)
    assert 0.2 <= time.monotonic() - start < 5


def _serving_step(model_dir: str, layout: tuple[int, int], shm_on: bool):
    """A mixed serving step (prefill + decode rows) on this layout; with `shm_on`, gloo's collectives
    are made to raise, so the step passes only if every one of its collectives went through shm."""
    import torch.distributed as dist

    from shiftlm.comm import shm
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan
    from shiftlm.serve.worker.runner import ModelRunner

    shm.disable_all()
    names = ("all_reduce", "broadcast", "gather", "all_gather", "all_to_all")
    saved = {name: getattr(dist, name) for name in names}
    try:
        tp, sp = layout
        mesh = Mesh(ParallelConfig(tp=tp, sp=sp))
        runner = ModelRunner.load(model_dir, mesh, num_blocks=32, block_size=4, shm_collectives=shm_on)
        assert (runner._local is not None) == shm_on and (shm.channel(mesh.shift) is not None) == shm_on
        if shm_on:
            for name in names:
                setattr(dist, name, lambda *a, _name=name, **k: (_ for _ in ()).throw(AssertionError(_name)))
        outs = []
        for mode in (Mode.TP, Mode.SP_TP):
            chunks = (
                ScheduledChunk(0, (5, 17, 33, 2, 9, 100, 7, 11), 0, tuple(range(4)), True, row=0),
                ScheduledChunk(1, (44, 3, 8, 19), 0, tuple(range(8, 12)), True, row=1),
            )
            outs.append(runner.run_step(StepPlan(0, mode, chunks)))
        return outs
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        shm.disable_all()


@needs_kernels
@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=["tp2", "sp2-shift"])
def test_a_serving_runner_steps_through_shm_with_gloos_results(ranks, tmp_path, layout):
    """The serving runner of a 2-rank layout enables the channel, every collective of a step in both
    modes goes through it (gloo's raise), and rank 0's logits equal the gloo runner's bit for bit."""
    from shiftlm.tools.tiny import make_tiny_checkpoint

    model_dir = str(make_tiny_checkpoint(tmp_path / "tiny", "llama-gqa"))
    with_shm = ranks.run(2, _serving_step, model_dir, layout, True)[0]
    with_gloo = ranks.run(2, _serving_step, model_dir, layout, False)[0]
    for got, want in zip(with_shm, with_gloo):
        assert torch.equal(got, want)
