"""Rank 0 watches the serving ranks: a dead or stalled rank is named within seconds (issue 13.2).

Three signals, checked every `interval` seconds by a thread on rank 0:
- a local worker process has exited (kill -9, OOM killer, a crash): "rank 1 (pid 123) died (signal 9)";
- a local worker's heartbeat is older than `rank_timeout`: every worker runs a thread that stamps a
  shared-memory clock twice a second, whether it computes or waits for the next plan, so a stopped
  (SIGSTOP) or wedged process is seen while the server idles too;
- the engine's current step has run longer than `step_timeout` (the only signal under torchrun, where
  rank 0 does not own the other processes): some rank stopped taking part in the step's collectives.
A collective would otherwise wait for its group's timeout (the plan group's is days). On any of them
the monitor calls `on_failure(reason)` once: the server fails every request, turns `/health` to 503
and exits non-zero, so that its supervisor (systemd, Kubernetes) restarts it (docs/serving.md).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

HEARTBEAT_INTERVAL = 0.5


def start_heartbeat(clock, parent_pid: int) -> threading.Thread:
    """In a worker: stamp `clock` (a multiprocessing.Value('d')) with time.monotonic() twice a second
    (CLOCK_MONOTONIC is one clock for every process of the host, and a wall-clock step of 10 s no
    longer reads as a stalled rank, issue 35.8), and
    exit at once if rank 0 is gone (its parent changed), so no orphan holds the model's memory."""

    def beat() -> None:
        while True:
            clock.value = time.monotonic()
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(HEARTBEAT_INTERVAL)

    thread = threading.Thread(target=beat, name="shiftlm-heartbeat", daemon=True)
    thread.start()
    return thread


def describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class RankMonitor:
    """Watches worker processes (rank, Process, heartbeat clock) and the engine's step time."""

    def __init__(
        self,
        workers: list[tuple[int, object, object]],
        rank_timeout: float = 10.0,
        step_timeout: float = 60.0,
        interval: float = 0.5,
    ):
        self.workers = workers
        self.rank_timeout, self.step_timeout, self.interval = rank_timeout, step_timeout, interval
        self.step_running_for: Callable[[], float] = lambda: 0.0
        self.on_failure: Callable[[str], None] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shiftlm-rank-monitor", daemon=True)

    def start(self, step_running_for: Callable[[], float], on_failure: Callable[[str], None]) -> RankMonitor:
        """Watch the engine's steps too, and call `on_failure(reason)` once on the first failure."""
        self.step_running_for, self.on_failure = step_running_for, on_failure
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> str | None:
        """The first failure seen now, as one sentence naming the rank (None if all is well)."""
        for rank, proc, clock in self.workers:
            if not proc.is_alive():
                return f"rank {rank} (pid {proc.pid}) died ({describe_exit(proc.exitcode)})"
            silent = time.monotonic() - clock.value
            if clock.value > 0 and silent > self.rank_timeout:
                return (
                    f"rank {rank} (pid {proc.pid}) stopped responding: no heartbeat for {silent:.1f} s "
                    f"(stopped, e.g. SIGSTOP, or wedged; bound --rank-timeout {self.rank_timeout:g} s)"
                )
        running = self.step_running_for()
        if running > self.step_timeout:
            return (
                f"an engine step has not returned after {running:.1f} s (bound --step-timeout "
                f"{self.step_timeout:g} s): a rank is stalled or gone"
            )
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            reason = self.check()
            if reason is not None:
                self.on_failure(reason)
                return
