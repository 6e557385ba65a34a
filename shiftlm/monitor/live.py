"""Straggler detection while training runs (C4, Dong et al. 2024, sec. 3.1: detect, then isolate).

Every `every` steps each rank hands the ledger records it made since the last check to rank 0
(`gather_object`: one small collective, outside the ledger); rank 0 runs `find_stragglers` over that
window, writes every rank's window to `<dump_dir>/ledger-rank{r}.json` (so `shiftlm monitor report
RUN` works after any run), appends the verdict to `<dump_dir>/stragglers.jsonl`, and logs

    [shiftlm.monitor] step 40: rank 3 (dp1 pp0 sp0 tp1) slowest in 36/36 collectives, +48 ms ...

A machine under load makes every rank late now and then, so a rank is named only when it clears
three bars: it is last in >= `min_fraction` of its collectives in the window (relative to its
peers), by a median delay above an absolute floor (`min_delay_ms`) *and* above `min_step_fraction`
of the median step time (a straggler that costs 1% of a step is not worth an operator's time), and
it did so in `persist` consecutive windows. With `exclude` (`shiftlm train --elastic`) rank 0
broadcasts the named rank, every rank saves a checkpoint, and the trainer raises `ExcludeRank` so
the launcher relaunches without it.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from shiftlm.comm.ledger import CollectiveLedger, RankLedger, ledger
from shiftlm.monitor.failure import ExcludeRank
from shiftlm.monitor.straggler import StragglerReport, find_stragglers


def straggler_watch(config, mesh, dump_dir: str | Path) -> StragglerWatch | None:
    """The trainer's watch per `config.monitor.straggler_every` (None: off, or a world of one);
    it asks to exclude a named rank when the elastic launcher started us ($SHIFTLM_ELASTIC=1)."""
    import os

    from shiftlm.monitor.failure import describe_coords

    every = config.monitor.straggler_every
    if every <= 0 or mesh.world_size == 1:
        return None
    return StragglerWatch(
        mesh.rank,
        mesh.world_size,
        every,
        dump_dir,
        describe=lambda rank: describe_coords(config.parallel, rank),
        exclude=os.environ.get("SHIFTLM_ELASTIC") == "1",
    )


class StragglerWatch:
    def __init__(
        self,
        rank: int,
        world_size: int,
        every: int,
        dump_dir: str | Path,
        describe: Callable[[int], str] = lambda rank: "",
        persist: int = 3,
        min_fraction: float = 0.8,
        min_delay_ms: float = 10.0,
        min_step_fraction: float = 0.03,
        min_collectives: int = 10,
        exclude: bool = False,
        target: CollectiveLedger = ledger,
    ):
        if every < 1 or persist < 1:
            raise ValueError(f"every ({every}) and persist ({persist}) must be >= 1")
        self.rank, self.world_size, self.every = rank, world_size, every
        self.dump_dir, self.describe, self.persist = Path(dump_dir), describe, persist
        self.min_fraction, self.min_delay_ms = min_fraction, min_delay_ms
        self.min_step_fraction, self.min_collectives = min_step_fraction, min_collectives
        self.exclude, self.ledger = exclude, target
        self.streak: dict[int, int] = {}
        self._since = time.time()
        self._step_times: list[float] = []
        self._checked_at = -1
        self.ledger.enable()

    def after_step(self, step: int, step_time_s: float, final: bool = False) -> ExcludeRank | None:
        """Call on every rank after every step (and once with `final` at the end): collective."""
        if not final:
            self._step_times.append(step_time_s)
        if (not final and step % self.every) or step == self._checked_at:
            return None
        self._checked_at = step
        snapshot = self.ledger.snapshot()
        since, self._since = self._since, time.time()
        snapshot.records = [r for r in snapshot.records if r.enter >= since]
        gathered: list[RankLedger] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(snapshot, gathered, dst=0)
        named = self._judge(step, gathered) if self.rank == 0 else None
        if self.exclude and not final:
            box = [named]
            dist.broadcast_object_list(box, src=0)
            named = box[0]
            if named is not None:
                return ExcludeRank(named[0], named[1])
        return None

    def _judge(self, step: int, ledgers: list[RankLedger]) -> tuple[int, str] | None:
        step_ms = 1e3 * statistics.median(self._step_times) if self._step_times else 0.0
        self._step_times.clear()
        floor = max(self.min_delay_ms, self.min_step_fraction * step_ms)
        report = find_stragglers(
            ledgers,
            window=10**9,  # the whole window since the last check
            min_fraction=self.min_fraction,
            min_delay_ms=floor,
            min_collectives=self.min_collectives,
        )
        self.streak = {r: self.streak.get(r, 0) + 1 for r in report.culprits}
        confirmed = sorted(r for r, n in self.streak.items() if n >= self.persist)
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        for entry in ledgers:
            entry.dump(self.dump_dir)
        lines = [self._line(step, report, r, step_ms) for r in confirmed]
        with (self.dump_dir / "stragglers.jsonl").open("a") as handle:
            handle.write(
                json.dumps(
                    {
                        "step": step,
                        "step_ms": step_ms,
                        "delay_floor_ms": floor,
                        "suspects": report.culprits,
                        "named": confirmed,
                        "lines": lines,
                        "report": report.to_dict(),
                    }
                )
                + "\n"
            )
        for line in lines:
            print(f"[shiftlm.monitor] {line}", file=sys.stderr, flush=True)
        return (confirmed[0], lines[0]) if confirmed else None

    def _line(self, step: int, report: StragglerReport, rank: int, step_ms: float) -> str:
        entry = next(e for e in report.ranks if e.rank == rank)
        return (
            f"step {step}: rank {rank} ({self.describe(rank)}) slowest in {entry.times_last}/"
            f"{entry.collectives} collectives, +{entry.median_delay_ms:.0f} ms median "
            f"(step {step_ms:.0f} ms; {self.streak[rank]} checks in a row)"
        )
