"""Straggler detection: the rank that enters last, consistently and by a lot, is named."""

import random
import time

import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftlm.comm import RankLedger, Record, all_gather, all_reduce, ledger
from shiftlm.mesh import Mesh
from shiftlm.monitor import faults
from shiftlm.monitor.clock import estimate_offsets
from shiftlm.monitor.straggler import find_stragglers, gather_ledgers
from shiftlm.parallel import ParallelConfig


def _train_like_steps(steps: int, jitter_ms: float, fault: str | None):
    """TP x DP = 2 x 2: per step a TP all-reduce, a DP all-reduce and a TP all-gather, with compute
    jitter before each; returns rank 0's straggler report over the gathered ledgers."""
    mesh = Mesh(ParallelConfig(dp=2, tp=2))
    rng = random.Random(dist.get_rank())
    injected = faults.inject(faults.parse_fault(fault)) if fault else None
    ledger.clear()
    ledger.enable()
    try:
        x = torch.ones(8)
        for step in range(steps):
            faults.set_step(step)
            for run_op in (
                lambda: all_reduce(x, mesh.tp),
                lambda: all_reduce(x, mesh.dp),
                lambda: all_gather(x, mesh.tp, dim=0),
            ):
                time.sleep(rng.uniform(0, jitter_ms) / 1e3)  # compute that varies from step to step
                run_op()
    finally:
        ledger.disable()
        faults.set_step(0)
        if injected:
            faults.remove(injected)
    report = find_stragglers(gather_ledgers())
    return report.to_dict()


def test_a_slow_rank_is_named_the_straggler(ranks):
    report = ranks.run(4, _train_like_steps, 12, 2.0, "slow:rank=3,ms=30")[0]
    assert report["culprits"] == [3]
    by_rank = {entry["rank"]: entry for entry in report["ranks"]}
    assert by_rank[3]["median_delay_ms"] > max(by_rank[r]["median_delay_ms"] for r in (0, 1))


def test_a_healthy_run_with_jitter_names_no_one(ranks):
    report = ranks.run(4, _train_like_steps, 20, 3.0, None)[0]
    assert report["culprits"] == []
    assert report["instances"] == 20 * 3 * 2  # three ops per step, two groups of each kind


def _synthetic(offsets, slow_rank, delay_s, jitter_s, rng, instances=40):
    """Two ranks, one group: true enters jittered, exits together; each host's clock is shifted."""
    records = {0: [], 1: []}
    for seq in range(instances):
        start = seq * 0.1
        enters = {r: start + rng.uniform(0, jitter_s) + (delay_s if r == slow_rank else 0.0) for r in (0, 1)}
        leave = max(enters.values()) + 1e-4
        for r in (0, 1):
            exit_time = leave + rng.uniform(0, 1e-5)
            records[r].append(
                Record("all_reduce", "dp", 64, seq, enters[r] + offsets[r], exit_time + offsets[r])
            )
    return [RankLedger(r, {"dp": (0, 1)}, records[r]) for r in (0, 1)]


@settings(max_examples=25, deadline=None)
@given(offset=st.floats(-50.0, 50.0), seed=st.integers(0, 2**16), slow=st.sampled_from([None, 0, 1]))
def test_clock_offsets_are_recovered_and_only_a_slow_rank_is_named(offset, seed, slow):
    ledgers = _synthetic({0: 0.0, 1: offset}, slow, 0.02, 0.003, random.Random(seed))
    assert abs(estimate_offsets(ledgers)[1] - offset) < 1e-4
    assert find_stragglers(ledgers).culprits == ([] if slow is None else [slow])
