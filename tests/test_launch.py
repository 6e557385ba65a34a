import pytest
import torch
import torch.distributed as dist

from shiftlm.launch import WorkerError


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
