"""The collective ledger records every shiftlm comm op, and agrees with the byte counters."""

from collections import defaultdict

import torch
import torch.distributed as dist

from shiftlm.comm import (
    all_gather,
    all_gather_flat,
    all_reduce,
    all_to_all,
    broadcast,
    counters,
    irecv,
    isend,
    ledger,
    reduce_scatter,
)
from shiftlm.mesh import Mesh
from shiftlm.parallel import ParallelConfig


def _every_op_once_per_rank():
    mesh = Mesh(ParallelConfig(dp=2))
    group = mesh.dp
    me, peer = dist.get_rank(), 1 - dist.get_rank()
    counters.reset()
    ledger.clear()
    ledger.enable()
    try:
        x = torch.full((4, 2), float(me + 1))
        summed = all_reduce(x, group)
        handle = all_reduce(x.clone(), group, async_op=True, in_place=True)
        in_flight_before_wait = len(ledger.in_flight())
        async_sum = handle.wait()
        gathered = all_gather(x, group, dim=0)
        flat = torch.empty(2 * x.numel())
        all_gather_flat(flat, x, group)
        scattered = reduce_scatter(x, group, dim=0)
        all_to_all(x, group, scatter_dim=0, gather_dim=1)
        broadcast(x.clone(), group)
        received = torch.empty(3)
        works = [isend(torch.arange(3.0) + me, peer, group, tag=7), irecv(received, peer, group, tag=7)]
        for work in works:
            work.wait()
    finally:
        ledger.disable()
    snapshot = ledger.snapshot()
    ledger_bytes = defaultdict(int)
    for record in snapshot.records:
        ledger_bytes[f"{record.op}/{record.group}"] += record.nbytes
    return {
        "ledger_bytes": dict(ledger_bytes),
        "counter_bytes": {key: value["bytes"] for key, value in counters.snapshot().items()},
        "rows": [(r.op, r.group, r.seq, r.peer, r.tag) for r in snapshot.records],
        "all_exited": all(r.exit is not None and r.exit >= r.enter for r in snapshot.records),
        "in_flight_before_wait": in_flight_before_wait,
        "results_ok": bool(
            torch.equal(summed, torch.full((4, 2), 3.0))
            and torch.equal(async_sum, summed)
            and torch.equal(flat.view(8, 2), gathered)
            and torch.equal(scattered, torch.full((2, 2), 3.0))
            and torch.equal(received, torch.arange(3.0) + peer)
        ),
    }


def test_ledger_bytes_agree_with_comm_counters_for_every_op(ranks):
    results = ranks.run(2, _every_op_once_per_rank)
    for result in results:
        assert result["results_ok"]
        assert result["ledger_bytes"] == result["counter_bytes"]
        assert result["all_exited"]
        assert result["in_flight_before_wait"] == 1  # the async all-reduce, until its wait()
    ops = [row[0] for row in results[0]["rows"]]
    assert ops == [
        "all_reduce",
        "all_reduce",
        "all_gather",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "broadcast",
        "send",
        "recv",
    ]


def test_sequence_numbers_match_across_ranks_and_count_per_group(ranks):
    rank0, rank1 = (result["rows"] for result in ranks.run(2, _every_op_once_per_rank))
    collectives0 = [row for row in rank0 if row[3] is None]
    assert collectives0 == [row for row in rank1 if row[3] is None]
    seqs = [row[2] for row in collectives0]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # one counter for the whole group
    send0 = next(row for row in rank0 if row[0] == "send")
    recv1 = next(row for row in rank1 if row[0] == "recv")
    assert (send0[2], send0[3], send0[4]) == (recv1[2], 1, 7) and recv1[3] == 0  # k-th send = k-th recv


def _ops_while_ledger_is_off():
    mesh = Mesh(ParallelConfig(dp=2))
    ledger.clear()
    before = ledger.progress().get("dp", 0)
    all_reduce(torch.ones(2), mesh.dp)
    return len(ledger.snapshot().records), ledger.progress()["dp"] - before


def test_a_disabled_ledger_keeps_no_records_but_keeps_counting_sequence_numbers(ranks):
    assert ranks.run(2, _ops_while_ledger_is_off) == [(0, 1), (0, 1)]
