"""Straggler detection from the collective ledgers (C4, Dong et al. 2024, sec. 3.1 and 4.2).

A collective cannot finish before its last member enters it, so in every instance (group, seq) the
last rank to enter is the one the others waited for, and the time the others waited *for it alone*
is the gap between the last and the second-to-last enter:

    delay(instance) = enter_last - enter_second_last          (clock offsets removed, see clock.py)

A healthy job has random jitter: each member is last about 1/|group| of the time, by a small
delay. A straggler is last in (nearly) every collective it takes part in, by a large delay. The
confidence rule names rank r the culprit when, over its last `window` collectives,

    times_last / collectives >= min_fraction   and   median delay when last >= min_delay_ms

and it took part in at least `min_collectives` of them. Waiting propagates (a rank held up by the
straggler in one group enters its next collective late), but such a victim is last only in the
groups the straggler is not in, so its fraction stays below the threshold.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch.distributed as dist

from shiftlm.comm.ledger import RankLedger, ledger
from shiftlm.monitor.clock import collective_instances, estimate_offsets


@dataclass
class RankLateness:
    """One rank's record over its last `window` collectives (times in milliseconds)."""

    rank: int
    collectives: int
    times_last: int
    last_fraction: float
    median_delay_ms: float  # when it was last: how long the second-to-last waited for it alone
    mean_lateness_ms: float  # its enter minus the median enter of its group, on average


@dataclass
class StragglerReport:
    ranks: list[RankLateness]
    culprits: list[int]
    instances: int  # collective instances that every member's ledger holds
    offsets_ms: dict[int, float]
    rule: str

    def to_dict(self) -> dict:
        return {**asdict(self), "offsets_ms": {str(r): v for r, v in self.offsets_ms.items()}}

    def summary(self) -> str:
        if not self.culprits:
            return f"no straggler ({self.rule}; {self.instances} collectives compared)"
        by_rank = {entry.rank: entry for entry in self.ranks}
        lines = [
            f"rank {r} is a straggler: last in {by_rank[r].times_last}/{by_rank[r].collectives} of its "
            f"collectives, the others waited a median {by_rank[r].median_delay_ms:.1f} ms for it"
            for r in self.culprits
        ]
        return "\n".join(lines)


def find_stragglers(
    ledgers: Sequence[RankLedger],
    window: int = 50,
    min_fraction: float = 0.8,
    min_delay_ms: float = 10.0,
    min_collectives: int = 10,
) -> StragglerReport:
    """Per-rank lateness over gathered ledgers, and the rank(s) that meet the confidence rule."""
    offsets = estimate_offsets(ledgers)
    instances = collective_instances(ledgers)
    # (reference-clock enter of the instance, rank, was last, delay when last, lateness vs median)
    samples: dict[int, list[tuple[float, bool, float, float]]] = defaultdict(list)
    for members in instances.values():
        enters = {rank: record.enter - offsets.get(rank, 0.0) for rank, record in members.items()}
        order = sorted(enters, key=enters.get)
        last, second = order[-1], order[-2]
        middle = statistics.median(enters.values())
        for rank, enter in enters.items():
            delay = enters[last] - enters[second] if rank == last else 0.0
            samples[rank].append((enter, rank == last, delay, enter - middle))
    report_ranks, culprits = [], []
    for rank in sorted(samples):
        recent = sorted(samples[rank])[-window:]
        delays = [delay for _, was_last, delay, _ in recent if was_last]
        entry = RankLateness(
            rank=rank,
            collectives=len(recent),
            times_last=len(delays),
            last_fraction=len(delays) / len(recent),
            median_delay_ms=1e3 * statistics.median(delays) if delays else 0.0,
            mean_lateness_ms=1e3 * statistics.fmean(lateness for *_, lateness in recent),
        )
        report_ranks.append(entry)
        if (
            entry.collectives >= min_collectives
            and entry.last_fraction >= min_fraction
            and entry.median_delay_ms >= min_delay_ms
        ):
            culprits.append(rank)
    rule = (
        f"last in >= {min_fraction:.0%} of >= {min_collectives} of its last {window} collectives "
        f"by a median >= {min_delay_ms:g} ms"
    )
    offsets_ms = {rank: 1e3 * offset for rank, offset in offsets.items()}
    return StragglerReport(report_ranks, culprits, len(instances), offsets_ms, rule)


def gather_ledgers(last: int = 256, group: dist.ProcessGroup | None = None) -> list[RankLedger]:
    """Every rank's last `last` records, on every rank (`all_gather_object`; call it on all ranks
    at the same point, e.g. every few hundred steps). The gather itself is not in the ledger."""
    snapshot = ledger.snapshot(last)
    gathered: list[RankLedger | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, snapshot, group=group)
    return list(gathered)
