"""The action IR, its CSV form, PyTorch's own validator, and our validator on every schedule."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.pipelining import schedules as torch_schedules

from shiftlm.pipeline.actions import Action, Kind, Placement, PlacementKind, Schedule, read_csv, write_csv
from shiftlm.pipeline.lowering import lower
from shiftlm.pipeline.schedules import SCHEDULES, build_schedule, check_requirements
from shiftlm.pipeline.validate import ScheduleError, validate


@pytest.mark.parametrize(
    "text", ["2F0", "1W3", "0SEND_F1", "3RECV_B12", "R1:2B0", "5GRAD_SYNC", "R1:0GRAD_SYNC"]
)
def test_action_string_round_trips(text):
    assert str(Action.parse(text)) == text


def test_action_string_is_pytorchs():
    assert str(Action(Kind.F, 2, 0)) == "2F0" == str(torch_schedules._Action.from_str("2F0"))
    with pytest.raises(ValueError, match="expected e.g."):
        Action.parse("F2")


@pytest.mark.parametrize("pp,expected", [(4, {0: [0, 7], 3: [3, 4]}), (2, {0: [0, 3], 1: [1, 2]})])
def test_v_placement_goes_down_and_back_up(pp, expected):
    placement = Placement(PlacementKind.V, pp, 2)
    for rank, stages in expected.items():
        assert [s for s, _ in placement.stages_of(rank)] == stages


def test_bitpipe_replicas_mirror_each_other():
    placement = Placement(PlacementKind.BIDIRECTIONAL, 4, 2)
    assert placement.stages_of(0) == [(0, 0), (7, 0), (3, 1), (4, 1)]
    for stage in range(8):  # the two copies of a stage sit on mirrored ranks
        assert placement.rank_of(stage, 1) == 3 - placement.rank_of(stage, 0)


def _torch_view(schedule: Schedule, replica: int) -> dict[int, list]:
    """One replica's actions as torch `_Action`s (PyTorch knows one model copy, no GRAD_SYNC)."""
    return {
        rank: [
            torch_schedules._Action.from_str(str(replace(a, replica=0)))
            for a in actions
            if a.replica == replica and a.kind is not Kind.GRAD_SYNC
        ]
        for rank, actions in enumerate(schedule.ranks)
    }


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_pytorchs_validator_accepts_our_csv(name, tmp_path):
    schedule = build_schedule(name, 4, 8)
    path = tmp_path / f"{name}.csv"
    write_csv(lower(schedule).ranks, path)
    assert read_csv(path) == [list(actions) for actions in lower(schedule).ranks]
    placement = schedule.placement
    for replica in range(placement.replicas):
        compute = _torch_view(schedule, replica)
        mapping = torch_schedules._validate_schedule(compute, 4, schedule.num_stages, 8 // placement.replicas)
        assert mapping == {s: placement.rank_of(s, replica) for s in range(schedule.num_stages)}
        lowered = _torch_view(lower(schedule), replica)
        torch_schedules._simulate_comms_compute(
            lowered, lambda s, r=replica: placement.rank_of(s, r), schedule.num_stages
        )


def _schedule_sizes():
    @st.composite
    def sizes(draw):
        name = draw(st.sampled_from(list(SCHEDULES)))
        pp = draw(st.integers(2, 6))
        microbatches = draw(st.integers(pp, 3 * pp))
        chunks = draw(st.integers(2, 4)) if name == "interleaved_1f1b" else None
        if name == "interleaved_1f1b":
            microbatches = pp * draw(st.integers(1, 3))
        if name == "bitpipe":
            microbatches += microbatches % 2
        if name == "dualpipe_v":
            microbatches = max(microbatches, 2 * pp)
        return name, pp, microbatches, chunks

    return sizes()


@settings(max_examples=40, deadline=None)
@given(_schedule_sizes())
def test_every_schedule_validates_runs_each_pass_once_and_never_deadlocks(size):
    name, pp, microbatches, chunks = size
    check_requirements(name, pp, microbatches, chunks)
    schedule = build_schedule(name, pp, microbatches, chunks)
    validate(schedule)  # once per (stage, micro-batch), right rank, no deadlock
    validate(lower(schedule))
    # each (stage, micro-batch) runs F and a backward, plus a W where that backward was split (DualPipeV
    # splits some and not others)
    splits = sum(a.kind is Kind.W for actions in schedule.ranks for a in actions)
    total = sum(len(schedule.compute_actions(r)) for r in range(pp))
    assert total == 2 * schedule.num_stages * microbatches + splits


def _one_f_one_b() -> Schedule:
    return build_schedule("1f1b", 2, 2)


def _with_rank(schedule: Schedule, rank: int, actions: list[Action]) -> Schedule:
    ranks = list(schedule.ranks)
    ranks[rank] = tuple(actions)
    return replace(schedule, ranks=tuple(ranks))


def test_validator_finds_a_deadlock_and_names_the_waiting_ranks():
    schedule = _one_f_one_b()
    rank1 = list(schedule.ranks[1])
    swapped = _with_rank(schedule, 1, [rank1[1], rank1[0], *rank1[2:]])  # B0 before F0 on the last stage
    with pytest.raises(ScheduleError, match="rank 1 waits at"):
        validate(swapped)


def test_validator_finds_a_missing_backward():
    schedule = _one_f_one_b()
    with pytest.raises(ScheduleError, match="stage 0 micro-batch 1"):
        validate(_with_rank(schedule, 0, [a for a in schedule.ranks[0] if str(a) != "0B1"]))


def test_validator_finds_an_action_on_the_wrong_rank():
    schedule = _one_f_one_b()
    with pytest.raises(ScheduleError, match="lives on rank 1"):
        validate(_with_rank(schedule, 0, [*schedule.ranks[0], Action(Kind.F, 1, 0)]))


def test_validator_finds_a_weight_gradient_before_its_input_gradient():
    schedule = build_schedule("zb_h1", 2, 2)
    rank0 = [a for a in schedule.ranks[0] if str(a) != "0W0"]
    with pytest.raises(ScheduleError, match="waits at 0W0"):
        validate(_with_rank(schedule, 0, [Action(Kind.W, 0, 0), *rank0]))
