"""The executor computes exactly what one rank computes: loss and every gradient (fp32, 1e-5)."""

from __future__ import annotations

import copy

import pytest
import torch

from shiftlm.model import deferred
from shiftlm.pipeline.executor import PipelineExecutor
from shiftlm.pipeline.schedules import SCHEDULES, build_schedule

MICROBATCH_ROWS = 3


def _full_model(num_stages: int) -> list[torch.nn.Module]:
    """One seeded model split into stages whose widths differ, so activation shapes change.

    The first linear of a stage defers its weight gradient to W, the second gets it in I."""
    torch.manual_seed(0)
    widths = [5 + stage % 3 for stage in range(num_stages + 1)]
    return [
        torch.nn.Sequential(
            deferred.Linear(widths[s], widths[s + 1]),
            torch.nn.Tanh(),
            torch.nn.Linear(widths[s + 1], widths[s + 1]),
        )
        for s in range(num_stages)
    ]


def _loss_fn(microbatches: int):
    return lambda output, target: torch.nn.functional.mse_loss(output, target, reduction="sum") / microbatches


def _data(full: list[torch.nn.Module], microbatches: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    in_width, out_width = full[0][0].in_features, full[-1][-1].out_features
    inputs = [torch.randn(MICROBATCH_ROWS, in_width, generator=generator) for _ in range(microbatches)]
    targets = [torch.randn(MICROBATCH_ROWS, out_width, generator=generator) for _ in range(microbatches)]
    return inputs, targets


def _reference(full: list[torch.nn.Module], inputs, targets) -> float:
    loss_fn, total = _loss_fn(len(inputs)), 0.0
    for x, target in zip(inputs, targets):
        for stage in full:
            x = stage(x)
        loss = loss_fn(x, target)
        loss.backward()
        total += loss.item()
    return total


def _max_relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def run_schedule(
    name: str, pp: int, microbatches: int, chunks: int | None = None, transport: str = "default"
):
    """`transport`: "default" (shared memory where it can be made), "gloo" (`shm_p2p=False`), or
    "shm-only" (shared memory required, and gloo's point-to-point made to raise during the steps)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    schedule = build_schedule(name, pp, microbatches, chunks)
    full = _full_model(schedule.num_stages)
    held = {key: copy.deepcopy(full[key[0]]) for key in schedule.placement.stages_of(rank)}
    inputs, targets = _data(full, microbatches)
    executor = PipelineExecutor(
        schedule,
        held,
        rank=rank,
        pp_group=None,
        pp_ranks=list(range(pp)),
        loss_fn=_loss_fn(microbatches),
        shm_p2p={"default": None, "gloo": False, "shm-only": True}[transport],
    )
    assert (executor._shm is None) == (transport == "gloo")
    from shiftlm.comm.shm_p2p import P2PChannel

    saved = dist.isend, dist.irecv, P2PChannel.isend, P2PChannel.irecv
    forbid = lambda *a, **k: (_ for _ in ()).throw(AssertionError(f"{transport}: the other transport"))  # noqa: E731
    if transport == "shm-only":
        dist.isend = dist.irecv = forbid
    elif transport == "gloo":  # a channel another test enabled on these ranks must not be used either
        P2PChannel.isend = P2PChannel.irecv = forbid
    try:
        # a first step on other data (activation shapes travel in headers), then the checked one (no
        # headers: receives posted ahead with the shapes learned on the first step)
        executor.step(*_data(full, microbatches, seed=7))
        for module in held.values():
            module.zero_grad(set_to_none=True)
        loss = executor.step(inputs, targets)
    finally:
        dist.isend, dist.irecv, P2PChannel.isend, P2PChannel.irecv = saved
    reference_loss = _reference(full, inputs, targets)
    errors = [
        _max_relative_error(mine.grad, want.grad)
        for (stage, _), module in held.items()
        for mine, want in zip(module.parameters(), full[stage].parameters())
    ]
    return (None if loss is None else loss.item()), reference_loss, max(errors)


def _check(results):
    losses = [loss for loss, _, _ in results if loss is not None]
    reference = results[0][1]
    assert losses, "no rank reported a loss"
    assert sum(losses) == pytest.approx(reference, rel=1e-5)
    assert max(error for _, _, error in results) <= 1e-5


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_two_rank_pipeline_matches_one_rank(ranks, name):
    _check(ranks.run(2, run_schedule, name, 2, 4))


@pytest.mark.parametrize("transport", ["gloo", "shm-only"])
@pytest.mark.parametrize("name", ["1f1b", "zb_v", "bitpipe"])
def test_pipeline_messages_through_either_transport(ranks, name, transport):
    """The shared-memory rings carry every message of a step (gloo's p2p raises) and gloo alone still
    works (the rings raise, even where another executor enabled them on these ranks): both give the
    one-rank loss and gradients."""
    _check(ranks.run(2, run_schedule, name, 2, 4, None, "default"))
    _check(ranks.run(2, run_schedule, name, 2, 4, None, transport))


@pytest.mark.parametrize(
    "name,chunks", [(name, 3 if name == "interleaved_1f1b" else None) for name in SCHEDULES]
)
def test_four_rank_pipeline_matches_one_rank(ranks, name, chunks):
    _check(ranks.run(4, run_schedule, name, 4, 8, chunks))


def test_executor_rejects_stages_that_do_not_match_the_placement():
    schedule = build_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="must hold stages"):
        PipelineExecutor(schedule, {1: torch.nn.Identity()}, rank=0)


def run_dp2_pp2(name: str, microbatches_per_replica: int):
    """World 4 = dp 2 x pp 2 (rank = dp * 2 + pp): each data-parallel copy pipelines its own half."""
    import torch.distributed as dist

    rank, pp = dist.get_rank(), 2
    dp_index, pp_rank = divmod(rank, pp)
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    total = 2 * microbatches_per_replica
    schedule = build_schedule(name, pp, microbatches_per_replica)
    full = _full_model(schedule.num_stages)
    held = {key: copy.deepcopy(full[key[0]]) for key in schedule.placement.stages_of(pp_rank)}
    inputs, targets = _data(full, total)
    mine = slice(dp_index * microbatches_per_replica, (dp_index + 1) * microbatches_per_replica)
    executor = PipelineExecutor(
        schedule,
        held,
        rank=pp_rank,
        pp_group=pp_groups[dp_index],
        pp_ranks=[dp_index * pp, dp_index * pp + 1],
        loss_fn=_loss_fn(total),
    )
    loss = executor.step(inputs[mine], targets[mine])
    for module in held.values():
        for param in module.parameters():
            dist.all_reduce(param.grad, group=dp_groups[pp_rank])
    reference_loss = _reference(full, inputs, targets)
    errors = [
        _max_relative_error(p.grad, q.grad)
        for (stage, _), module in held.items()
        for p, q in zip(module.parameters(), full[stage].parameters())
    ]
    return (None if loss is None else loss.item()), reference_loss, max(errors)


@pytest.mark.parametrize("name", ["1f1b", "zb_v", "bitpipe"])
def test_pipeline_inside_data_parallel_matches_one_rank(ranks, name):
    _check(ranks.run(4, run_dp2_pp2, name, 4))
