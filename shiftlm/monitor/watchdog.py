"""A per-rank watchdog: names the dead or hung rank, dumps the ledger, exits so torchrun restarts.

A stuck collective cannot tell us who is missing, so the watchdog talks over a side channel that
does not depend on it: the c10d key-value store (torchrun's agent store, or the TCPStore at
MASTER_ADDR:MASTER_PORT). Every `interval_s` its thread publishes this rank's heartbeat (progress
per group, the op it is in, the time: a few hundred bytes). When this rank's oldest in-flight op
is older than `timeout_s`, it reads every rank's heartbeat, diagnoses (`monitor.hang`), writes
`ledger-rank{r}.json` (records + diagnosis + heartbeats) into `dump_dir`, prints one line and calls
`os._exit(HANG_EXIT_CODE)`. Under `torchrun --max-restarts N` the agent then restarts the whole
job, which resumes from its last checkpoint.

    watchdog = Watchdog(connect_store(), rank, world_size, timeout_s=300, dump_dir="runs/x/hang")
    watchdog.start()   # also switches the ledger on

`timeout_s` must be below the process group's own timeout (else the collective raises first) and
well above `interval_s` and the slowest legitimate op (a checkpoint barrier, the first step).
Heartbeat ages compare wall clocks across hosts: NTP's milliseconds are far below `stale_s`.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from shiftlm.comm.ledger import CollectiveLedger, ledger
from shiftlm.monitor import failure
from shiftlm.monitor.hang import HangDiagnosis, Heartbeat, diagnose, pending_op

HANG_EXIT_CODE = failure.EXIT_TEMPFAIL  # 75, EX_TEMPFAIL (sysexits.h): a temporary failure, worth a restart
HangHandler = Callable[[HangDiagnosis, Path], None]


def connect_store(timeout_s: float = 30.0) -> dist.Store:
    """A client of the job's store (from MASTER_ADDR/MASTER_PORT), keys prefixed per restart."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.PrefixStore(f"shiftlm-monitor/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def terminate(diagnosis: HangDiagnosis, dump: Path) -> None:
    """The default hang handler: one clear line on stderr, then a distinct exit code."""
    print(
        f"[shiftlm.monitor] hang on rank {diagnosis.rank}: {diagnosis.message()}; ledger in {dump}; "
        f"exiting with code {HANG_EXIT_CODE} so that torchrun restarts the job",
        file=sys.stderr,
        flush=True,
    )
    culprits = list(diagnosis.root_causes) or sorted(diagnosis.missing)
    failure.report(failure.FailureReport(diagnosis.rank, "hang", diagnosis.message(), "", culprits))
    os._exit(HANG_EXIT_CODE)


class Watchdog:
    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout_s: float = 300.0,
        interval_s: float = 1.0,
        dump_dir: str | Path = "shiftlm-hang",
        on_hang: HangHandler = terminate,
        target: CollectiveLedger = ledger,
    ):
        if timeout_s <= 2 * interval_s:
            raise ValueError(f"timeout_s ({timeout_s}) must be well above interval_s ({interval_s})")
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.dump_dir, self.on_hang, self.ledger = Path(dump_dir), on_hang, target
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"shiftlm-watchdog-{rank}", daemon=True)

    def start(self) -> Watchdog:
        self.ledger.enable()
        self._publish()  # before the first op, so a rank that dies early still shows up
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _heartbeat(self) -> Heartbeat:
        in_flight = self.ledger.in_flight()
        pending = None
        if in_flight:
            oldest = in_flight[0]
            pending = pending_op(oldest, self.rank, self.ledger.groups[oldest.group])
        return {
            "rank": self.rank,
            "time": time.time(),
            "progress": self.ledger.progress(),
            "pending": pending,
        }

    def _publish(self) -> Heartbeat:
        beat = self._heartbeat()
        self.store.set(f"heartbeat/{self.rank}", json.dumps(beat))
        return beat

    def _read_heartbeats(self) -> dict[int, Heartbeat | None]:
        beats: dict[int, Heartbeat | None] = {}
        for rank in range(self.world_size):
            key = f"heartbeat/{rank}"
            try:
                beats[rank] = json.loads(self.store.get(key)) if self.store.check([key]) else None
            except (RuntimeError, OSError):  # the store's host is gone: diagnose with what we have
                beats[rank] = None
        return beats

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            beat = self._publish()
            pending = beat["pending"]
            if pending is not None and beat["time"] - pending["since"] > self.timeout_s:
                self._on_timeout(pending)
                return

    def _on_timeout(self, pending: dict) -> None:
        heartbeats = self._read_heartbeats()
        heartbeats[self.rank] = self._heartbeat()
        diagnosis = diagnose(pending, heartbeats, time.time(), stale_s=3 * self.interval_s)
        snapshot = self.ledger.snapshot()
        snapshot.extra = {
            "hang": diagnosis.to_dict(),
            "heartbeats": {str(r): b for r, b in heartbeats.items()},
        }
        self.on_hang(diagnosis, snapshot.dump(self.dump_dir))
