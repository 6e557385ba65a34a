"""How a rank waits for a blocking collective: sleep in it (default), or poll it for a while first.

A gloo collective hands the call to the process group's worker thread, which hands the bytes to gloo's
socket thread; the caller sleeps on a condition variable until the worker signals it. When the peer
is late, every waiting thread sleeps and the core halts, and each of those wake-ups costs tens to
hundreds of microseconds on a virtual machine. Serving runs up to ten collectives per step (the plan
broadcast, two row-parallel sums per layer, the logits gather), so on a 2-core VM a 2-rank decode
step took 15-20 ms of wall time for 6-7 ms of CPU (bench/results/serving_history.md, "Waiting ranks").

`set_spin_wait(seconds)` makes every blocking collective of `comm.ops` (and the serving runner's
plan broadcast and logits gather) start asynchronously and poll `work.is_completed()` for up to
`seconds`, yielding the core (`os.sched_yield`, which also drops the GIL) between polls, then sleep
in `work.wait()` as before; an idle server stops polling after `seconds`. Off (0) by default;
`shiftlm serve --spin-wait S` turns it on for its CPU ranks > 0 only. Measured (bench/results/serving_history.md,
"Waiting ranks"): with a core per rank a 2-rank decode step drops from 15-27 to 10-19 ms of wall time;
but a poll only helps where nothing else needs the core. Linux's `sched_yield` does not hand a core to
another process for long, so a polling rank 1 slowed the benchmark client sharing its core (TTFT x3),
and in rank 0 the poll holds the GIL between yields and starved the HTTP thread (TTFT 0.6 -> 5 s).
"""

from __future__ import annotations

import os
import time

_spin_seconds = 0.0


def set_spin_wait(seconds: float) -> None:
    """Poll blocking collectives for up to `seconds` before sleeping in them (0: always sleep)."""
    global _spin_seconds
    if seconds < 0:
        raise ValueError(f"spin wait must be >= 0 seconds, got {seconds}")
    _spin_seconds = float(seconds)


def spin_wait_seconds() -> float:
    return _spin_seconds


def run_blocking(collective, *args, **kwargs):
    """`collective(*args, **kwargs)` (a `torch.distributed` call) to completion, polled per the policy."""
    if _spin_seconds <= 0:
        return collective(*args, **kwargs)
    work = collective(*args, async_op=True, **kwargs)
    if work is None:  # this rank is not in the group
        return None
    deadline = time.perf_counter() + _spin_seconds
    while not work.is_completed() and time.perf_counter() < deadline:
        os.sched_yield()
    work.wait()  # raises a failed collective's error; returns at once when it completed
    return None
