import pytest
import torch
import torch.distributed as dist

from shiftlm.launch import Pools, RankFailure, WorkerError, run_ranks


def _sum_of_ranks():
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    return value.item()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    return dist.get_rank()


def test_every_rank_joins_one_group(ranks):
    assert ranks.run(2, _sum_of_ranks) == [1.0, 1.0]


def test_an_error_on_one_rank_names_that_rank(ranks):
    with pytest.raises(WorkerError, match="(?s)rank 1.*boom on rank one"):
        ranks.run(2, _fail_on_rank_one)
    assert ranks.run(2, _sum_of_ranks) == [1.0, 1.0]  # the pool comes back for the next test


def _pid():
    import os

    return os.getpid()


def test_pools_keep_one_pool_per_world_size_and_close_them_all():
    """`shiftlm verify`'s and the suite's pools: a world size's ranks serve every call until one fails,
    and closing leaves no process behind."""
    with Pools() as pools:
        first = pools.run(2, _pid)
        assert pools.run(1, _pid)[0] not in first and pools.run(2, _pid) == first
        with pytest.raises(WorkerError):
            pools.run(2, _fail_on_rank_one)
        again = pools.run(2, _pid)
        assert set(again).isdisjoint(first)  # a failed pool is replaced, not reused
        processes = [proc for pool in pools._pools.values() for proc in pool._procs]
    assert len(processes) == 3 and not any(proc.is_alive() for proc in processes)


def _raise_on_rank_one_while_rank_zero_waits():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 would wait here until the process group's timeout (30 min)


def _kill_rank_one():
    import os
    import signal

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_run_ranks_names_the_raising_rank_and_stops_the_waiting_one_within_seconds():
    with pytest.raises(RankFailure) as caught:
        run_ranks(_raise_on_rank_one_while_rank_zero_waits, 2, describe=lambda r: f"dp{r}")
    failure = caught.value
    assert (failure.report.rank, failure.report.kind, failure.exit_code) == (1, "exception", 1)
    assert "rank 1 (dp1) failed: ValueError: boom on rank one" in failure.text()
    assert "_raise_on_rank_one_while_rank_zero_waits" in failure.report.traceback
    assert failure.stopped_s < 10


def test_run_ranks_reports_a_killed_rank_as_dead_with_exit_code_75():
    with pytest.raises(RankFailure) as caught:
        run_ranks(_kill_rank_one, 2)
    assert (caught.value.report.rank, caught.value.report.kind, caught.value.exit_code) == (1, "died", 75)
    assert "killed by SIGKILL" in caught.value.report.message


def test_run_ranks_returns_rank_zeros_result():
    assert run_ranks(_sum_of_ranks, 2) == 1.0
