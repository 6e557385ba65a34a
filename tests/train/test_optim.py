from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shiftlm.comm import CommGroup
from shiftlm.train.config import OptimSection
from shiftlm.train.flat import FlatParameters
from shiftlm.train.grad_sync import GradSync
from shiftlm.train.optim import clip_coefficient, learning_rate
from shiftlm.train.zero import ShardedAdamW, global_grad_norm


def test_lr_warms_up_linearly_then_decays_by_cosine_to_min_lr():
    optim = OptimSection(lr=1.0, min_lr=0.1, warmup_steps=4)
    assert [learning_rate(s, 20, optim) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert learning_rate(12, 20, optim) == pytest.approx(0.55)  # half way: the mean of lr and min_lr
    assert learning_rate(20, 20, optim) == pytest.approx(0.1)


def test_clipping_scales_only_norms_above_the_limit():
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(4.0, 1.0) == pytest.approx(0.25)
    assert clip_coefficient(4.0, 0.0) == 1.0


def _world_group() -> CommGroup:
    ranks = tuple(range(dist.get_world_size()))
    return CommGroup("dp", ranks, dist.group.WORLD, dist.get_rank())


def _train_two_linears(zero: bool, bucket_bytes: int) -> list[float]:
    """Each rank sees different data; gradients are summed by the bucketed sync; returns weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    group = _world_group()
    flat = FlatParameters(list(model.named_parameters()), pad_to=group.size)
    sync = GradSync(flat, group, bucket_bytes=bucket_bytes)
    optimizer = ShardedAdamW(
        flat, group, OptimSection(weight_decay=0.1), flat.mask(lambda n, s: len(s) == 2), shard=zero
    )
    for step in range(3):
        flat.zero_grad()
        sync.begin_step(2)
        for micro in range(2):
            x = torch.randn(
                4, 6, generator=torch.Generator().manual_seed(100 * step + 10 * dist.get_rank() + micro)
            )
            model(x).pow(2).sum().backward()
        sync.finish()
        optimizer.step(lr=0.01)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def _reference_weights() -> list[float]:
    """The same three steps on one process, with the data of both ranks."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    flat = FlatParameters(list(model.named_parameters()))
    single = CommGroup("dp", (0,), None, 0)
    optimizer = ShardedAdamW(
        flat, single, OptimSection(weight_decay=0.1), flat.mask(lambda n, s: len(s) == 2), shard=False
    )
    for step in range(3):
        flat.zero_grad()
        for rank in range(2):
            for micro in range(2):
                x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + 10 * rank + micro))
                model(x).pow(2).sum().backward()
        optimizer.step(lr=0.01)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


@pytest.mark.parametrize(("zero", "bucket_bytes"), [(True, 64), (False, 64), (True, 1 << 20)])
def test_dp_sync_and_zero1_match_one_process_on_the_whole_batch(ranks, zero, bucket_bytes):
    per_rank = ranks.run(2, _train_two_linears, zero, bucket_bytes)
    assert per_rank[0] == per_rank[1]  # replicas stay identical
    assert per_rank[0] == pytest.approx(_reference_weights(), rel=1e-5, abs=1e-7)


def test_the_gradient_norm_of_a_wide_range_buffer_is_its_fp64_norm():
    """3e6 gradients over four orders of magnitude on one rank: the clip norm is the fp64 norm to
    1e-6. MKL's `torch.dot` (what it was) adds into a few running fp32 sums and rounds the small squares
    away: 3.9e-5 low here, the 7.6e-5 by which one rank missed `--dry-run`'s 5e-5 grad-norm check."""
    torch.manual_seed(0)
    grads = torch.randn(3_000_000) * 10 ** (-4 * torch.rand(3_000_000))
    mask = torch.ones_like(grads)
    exact = grads.double().norm().item()
    flat = FlatParameters([("w", torch.nn.Parameter(torch.zeros(grads.numel())))])
    flat.grads.copy_(grads)
    assert global_grad_norm(flat, mask, []) == pytest.approx(exact, rel=1e-6)
    assert abs(torch.dot(grads, grads).sqrt().item() - exact) / exact > 1e-5  # the old sum could not pass
