"""Clock offsets between ranks, estimated from the collectives themselves.

Enter times are read from each host's own clock, so before comparing them across hosts we need
each rank's offset. A blocking collective (all-reduce, all-gather, reduce-scatter, all-to-all) ends
on every rank at about the same moment: nobody can leave before the last rank's data has arrived,
and everyone leaves soon after. So for two ranks a, b that took part in the same instance,

    exit_a - exit_b  ~=  offset_a - offset_b        (true exit times equal, up to wake-up jitter)

The pairwise estimate is the median of that difference over all shared instances (robust to the odd
late wake-up); offsets relative to the lowest rank follow along a breadth-first spanning tree of the
"shared a collective" graph. Broadcasts (the root may leave first) and asynchronous ops (whose exit
is whenever the caller chose to wait) are not sync points and are skipped. On one host every rank
reads the same clock and the estimates come out at the jitter level (tens of microseconds).
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from collections.abc import Sequence

from shiftlm.comm.ledger import P2P_OPS, RankLedger, Record

NOT_SYNC_POINTS = ("broadcast", *P2P_OPS)
InstanceKey = tuple[str, tuple[int, ...], int]  # (group name, group ranks, seq)


def collective_instances(ledgers: Sequence[RankLedger]) -> dict[InstanceKey, dict[int, Record]]:
    """(group, ranks, seq) -> {rank: record}, for finished collectives seen by every group member."""
    seen: dict[InstanceKey, dict[int, Record]] = defaultdict(dict)
    for rank_ledger in ledgers:
        for record in rank_ledger.records:
            if record.peer is None and record.exit is not None:
                ranks = rank_ledger.groups[record.group]
                seen[(record.group, ranks, record.seq)][rank_ledger.rank] = record
    return {key: members for key, members in seen.items() if len(members) == len(key[1])}


def estimate_offsets(ledgers: Sequence[RankLedger]) -> dict[int, float]:
    """rank -> clock offset in seconds relative to the lowest rank (subtract it from that rank's times).

    A rank that shares no synchronising collective with the others keeps offset 0.
    """
    differences: dict[tuple[int, int], list[float]] = defaultdict(list)
    for members in collective_instances(ledgers).values():
        sync = {r: rec for r, rec in members.items() if rec.op not in NOT_SYNC_POINTS and not rec.async_op}
        ranks = sorted(sync)
        for a in ranks:
            for b in ranks:
                if a != b:
                    differences[(a, b)].append(sync[a].exit - sync[b].exit)
    neighbours: dict[int, list[int]] = defaultdict(list)
    for a, b in differences:
        neighbours[a].append(b)
    all_ranks = sorted(rank_ledger.rank for rank_ledger in ledgers)
    offsets: dict[int, float] = {}
    for root in all_ranks:  # one spanning tree per connected component, rooted at its lowest rank
        if root in offsets:
            continue
        offsets[root] = 0.0
        queue = deque([root])
        while queue:
            known = queue.popleft()
            for other in neighbours[known]:
                if other not in offsets:
                    offsets[other] = offsets[known] + statistics.median(differences[(other, known)])
                    queue.append(other)
    return offsets
