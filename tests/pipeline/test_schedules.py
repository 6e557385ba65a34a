"""The simulator reproduces the published bubble and memory formulas with T_F = T_I = T_W = 1."""

from __future__ import annotations

import time
from dataclasses import replace
from fractions import Fraction

import pytest

from shiftlm.pipeline.actions import Kind
from shiftlm.pipeline.schedules import SCHEDULES, build_schedule
from shiftlm.pipeline.simulator import ActionCosts, simulate

UNIT = ActionCosts(forward=1.0, backward_input=1.0, backward_weight=1.0)
SIZES = [(2, 2), (2, 5), (3, 6), (4, 8), (4, 12), (8, 16)]


def bubble(name: str, pp: int, microbatches: int, chunks: int | None = None) -> float:
    return simulate(build_schedule(name, pp, microbatches, chunks), UNIT).bubble_fraction


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,microbatches", SIZES)
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, pp, microbatches):
    assert bubble(name, pp, microbatches) == pytest.approx(float(Fraction(pp - 1, microbatches + pp - 1)))


@pytest.mark.parametrize("chunks", [2, 3, 4])
@pytest.mark.parametrize("pp,microbatches", [(2, 4), (3, 6), (4, 8), (4, 12), (8, 16)])
def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1(chunks, pp, microbatches):
    expected = Fraction(pp - 1, chunks * microbatches + pp - 1)
    assert bubble("interleaved_1f1b", pp, microbatches, chunks) == pytest.approx(float(expected))


@pytest.mark.parametrize("pp,microbatches", SIZES)
def test_zb_h1_bubble_is_p_minus_1_over_3m_plus_p_minus_1(pp, microbatches):
    assert bubble("zb_h1", pp, microbatches) == pytest.approx(
        float(Fraction(pp - 1, 3 * microbatches + pp - 1))
    )


def test_zb_h1_bubble_is_a_third_of_1f1b_for_many_microbatches():
    assert bubble("zb_h1", 4, 400) / bubble("1f1b", 4, 400) == pytest.approx(1 / 3, rel=0.01)


@pytest.mark.parametrize("name", ["zb_h2", "zb_v"])
@pytest.mark.parametrize("pp,microbatches", [(2, 4), (3, 6), (4, 8), (4, 12), (8, 16)])
def test_zero_bubble_schedules_never_idle_inside_a_ranks_span(name, pp, microbatches):
    result = simulate(build_schedule(name, pp, microbatches), UNIT)
    assert [result.idle_inside_span(rank) for rank in range(pp)] == [0.0] * pp


@pytest.mark.parametrize("pp,microbatches", SIZES)
def test_1f1b_rank_r_holds_p_minus_r_activations(pp, microbatches):
    result = simulate(build_schedule("1f1b", pp, microbatches), UNIT)
    assert result.peak_activations == [min(pp - r, microbatches) for r in range(pp)]


@pytest.mark.parametrize("pp,microbatches", [(2, 4), (3, 6), (4, 8), (8, 16)])
def test_zb_v_holds_p_microbatches_of_activations_on_every_rank(pp, microbatches):
    result = simulate(build_schedule("zb_v", pp, microbatches), UNIT)
    assert result.peak_memory == [float(pp)] * pp  # 2p half-size chunks = p whole-rank micro-batches
    assert result.peak_activations == [2 * pp] * pp


def test_zb_h2_holds_2p_minus_1_activations():
    assert simulate(build_schedule("zb_h2", 4, 8), UNIT).peak_activations == [7] * 4


def test_bitpipe_beats_1f1b_and_interleaved_for_p4_m8():
    assert bubble("bitpipe", 4, 8) < bubble("interleaved_1f1b", 4, 8, 2) < bubble("1f1b", 4, 8)


def test_bitpipe_syncs_every_chunk_once_right_after_its_last_backward():
    schedule = build_schedule("bitpipe", 4, 8)
    for actions in schedule.ranks:
        syncs = [i for i, a in enumerate(actions) if a.kind is Kind.GRAD_SYNC]
        assert len(syncs) == 4  # 2 chunks x 2 replicas per rank
        for index in syncs:
            sync = actions[index]
            backwards = [
                i
                for i, a in enumerate(actions)
                if a.kind is Kind.B and (a.stage, a.replica) == (sync.stage, sync.replica)
            ]
            assert max(backwards) == index - 1


def test_per_stage_costs_slow_down_the_pipeline_by_the_slowest_stage():
    schedule = build_schedule("1f1b", 4, 8)
    even = simulate(schedule, UNIT).makespan
    skewed = simulate(
        schedule, ActionCosts(forward=[1, 1, 2, 1], backward_input=1, backward_weight=1)
    ).makespan
    assert skewed > even


@pytest.mark.parametrize("name", ["zb_h1", "dualpipe_v", "1f1b"])
def test_split_forward_prices_exactly_the_forwards_of_split_micro_batches(name):
    """`split_forward` is what the forward of a micro-batch with an I + W split costs (the trainer's
    compiled blocks run those eagerly): every rank's busy time counts it once per such forward,
    and a schedule that splits none does not see it. dualpipe_v splits some micro-batches only."""
    schedule = build_schedule(name, 4, 8)
    split = {(a.stage, a.microbatch, a.replica) for rank in schedule.ranks for a in rank if a.kind is Kind.I}
    costs = ActionCosts(
        forward=1.0, backward_input=2.0, backward_weight=1.5, backward=3.0, split_forward=1.75
    )
    result = simulate(schedule, costs)
    per_kind = {Kind.B: 3.0, Kind.I: 2.0, Kind.W: 1.5}
    for rank, actions in enumerate(schedule.ranks):
        expected = sum(
            (1.75 if (a.stage, a.microbatch, a.replica) in split else 1.0)
            if a.kind is Kind.F
            else per_kind[a.kind]
            for a in actions
            if a.kind in (Kind.F, Kind.B, Kind.I, Kind.W)
        )
        assert result.busy[rank] == pytest.approx(expected)
    plain = simulate(schedule, replace(costs, split_forward=None)).makespan
    assert (result.makespan > plain) is bool(split)


def test_messages_count_every_cross_rank_hand_off_and_bytes_add_up():
    schedule = build_schedule("1f1b", 4, 8)
    result = simulate(schedule, ActionCosts(activation_bytes=100.0))
    assert result.messages == 2 * 3 * 8  # 3 boundaries, forward and backward, 8 micro-batches
    assert result.message_bytes == 100.0 * result.messages


def test_zb_v_turn_of_the_v_is_a_local_hand_off_without_messages():
    result = simulate(build_schedule("zb_v", 4, 8))
    assert result.messages == 2 * (2 * 4 - 2) * 8  # 8 stages = 7 boundaries, one of them on rank 3


def test_p2p_latency_adds_to_the_critical_path():
    schedule = build_schedule("1f1b", 4, 8)
    slow = simulate(schedule, ActionCosts(p2p=0.5)).makespan
    # the first micro-batch crosses 3 links forward and 3 back before rank 0 can run its backward
    assert slow >= simulate(schedule).makespan + 2 * 3 * 0.5


def test_simulating_a_large_layout_stays_linear():
    # p=64, m=512 is ~200k actions; a quadratic scan would take minutes
    start = time.perf_counter()
    simulate(build_schedule("1f1b", 64, 512))
    assert time.perf_counter() - start < 30  # generous: guards against O(n^2), not a speed claim


@pytest.mark.parametrize(
    "name,pp,microbatches,chunks,message",
    [
        ("1f1b", 4, 3, None, "at least 4 micro-batches"),
        ("gpipe", 4, 8, 2, "always uses 1 chunk"),
        ("zb_v", 4, 8, 3, "always uses 2 chunk"),
        ("interleaved_1f1b", 4, 6, 2, "divisible by pp=4"),
        ("interleaved_1f1b", 4, 8, 1, "at least 2 chunks"),
        ("bitpipe", 4, 9, None, "even number"),
        ("dualpipe_v", 4, 7, None, "at least 8 micro-batches"),
        ("pipedream", 4, 8, None, "unknown schedule"),
        ("1f1b", 1, 8, None, "at least 2 pipeline ranks"),
    ],
)
def test_invalid_combinations_are_rejected_with_a_fix(name, pp, microbatches, chunks, message):
    with pytest.raises(ValueError, match=message):
        build_schedule(name, pp, microbatches, chunks)


def test_every_schedule_is_registered_with_a_summary():
    assert set(SCHEDULES) == {
        "gpipe",
        "1f1b",
        "interleaved_1f1b",
        "zb_h1",
        "zb_h2",
        "zb_v",
        "bitpipe",
        "dualpipe_v",
    }


@pytest.mark.parametrize("pp,microbatches", [(2, 4), (2, 8), (3, 7), (4, 8), (4, 11), (5, 16)])
def test_dualpipe_v_runs_pytorchs_order_with_each_overlapped_pair_as_f_then_b(pp, microbatches):
    """Our DualPipeV is PyTorch's `ScheduleDualPipeV` (from deepseek-ai/DualPipe) action for action."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    letters = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    ours = build_schedule("dualpipe_v", pp, microbatches)
    for rank in range(pp):
        fake = SimpleNamespace(pp_group_size=pp, _n_microbatches=microbatches)
        theirs = []
        for action in ScheduleDualPipeV._calculate_single_rank_operations(fake, rank):
            for sub in action.sub_actions or (action,):
                theirs.append(f"{sub.stage_index}{letters[sub.computation_type.name]}{sub.microbatch_index}")
        assert [str(a) for a in ours.ranks[rank]] == theirs


def test_bitpipe_at_p2_leaves_slack_before_remote_inputs_and_wins_once_messages_take_time():
    from shiftlm.pipeline.actions import Placement, PlacementKind, Schedule
    from shiftlm.pipeline.greedy import greedy_order

    placement = Placement(PlacementKind.BIDIRECTIONAL, 2, 2)
    costs = ActionCosts(forward=1.0, backward_input=1.0, backward_weight=1.0, p2p=0.25)

    def makespan(latency: float) -> float:
        ranks = greedy_order(placement, 8, [6, 6], split_backward=False, grad_sync=True, latency=latency)
        return simulate(Schedule("bitpipe", placement, 8, tuple(tuple(a) for a in ranks)), costs).makespan

    assert makespan(0.5) < makespan(0.0)
    chosen = build_schedule("bitpipe", 2, 8)
    assert simulate(chosen, costs).makespan == makespan(0.5)
    first = chosen.ranks[0]  # rank 0 runs a second local forward before the one fed by rank 1
    assert [(a.kind, a.stage) for a in first[:3]] == [(Kind.F, 0), (Kind.F, 0), (Kind.F, 1)]
    assert bubble("bitpipe", 2, 8) == 0.0  # no worse without message time
