"""One job on N fresh local processes, supervised as torchrun's agent does (`shiftlm train --nproc`):
the first rank to fail is named with its traceback, the others stopped within seconds, and the exit
code says whether to restart (`shiftlm.monitor.failure`)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from shiftlm.launch.pools import free_port, set_rank_env


class RankFailure(RuntimeError):
    """A job on local ranks failed; `report` is the root cause, `exit_code` what the CLI returns."""

    def __init__(self, report, others: list, stopped_s: float, describe: Callable[[int], str]):
        self.report, self.others, self.stopped_s, self.describe = report, others, stopped_s, describe
        super().__init__(self.headline())

    @property
    def exit_code(self) -> int:
        return self.report.exit_code

    def headline(self) -> str:
        report = self.report
        where = f"rank {report.rank} ({self.describe(report.rank)})"
        if report.kind == "hang" and report.culprits:
            blamed = ", ".join(f"rank {r} ({self.describe(r)})" for r in report.culprits)
            return f"hang: {blamed} stopped communicating; seen by {where}: {report.message}"
        if report.kind == "straggler":
            return f"{report.message}; relaunching without it"
        return f"{where} failed: {report.message}"

    def text(self) -> str:
        """The headline, the failed rank's own traceback, and what happened to the other ranks."""
        lines = [f"[shiftlm] {self.headline()}"]
        if self.report.traceback:
            lines.append(f"[shiftlm] traceback of rank {self.report.rank}:")
            lines.append(self.report.traceback.rstrip())
        for other in self.others:
            lines.append(f"[shiftlm]   then rank {other.rank} ({self.describe(other.rank)}): {other.message}")
        lines.append(
            f"[shiftlm] stopped every rank {self.stopped_s:.1f} s after the first failure; "
            f"exit code {self.exit_code}"
        )
        return "\n".join(lines)


class Interrupted(KeyboardInterrupt):
    """SIGINT/SIGTERM stopped a `run_ranks` job before rank 0 returned (before its first step, or by
    a second signal); `signum` is the first signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Forward:
    """While ranks run (main thread only): pass the first SIGINT/SIGTERM on to every live rank, which
    stops at its next step boundary with a checkpoint (train/stopping.py); a second one stops them now."""

    def __init__(self, procs: list):
        self.procs, self.received, self._previous = procs, 0, {}

    def __enter__(self) -> _Forward:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.received:
            raise Interrupted(self.received)
        self.received = signum
        print(
            f"[shiftlm] {signal.Signals(signum).name}: stopping at the next step boundary with a "
            "checkpoint (again to stop now)",
            file=sys.stderr,
            flush=True,
        )
        for proc in self.procs:
            if proc.is_alive():
                os.kill(proc.pid, signum)


def _rank_main(rank: int, world_size: int, port: int, conn, env: dict[str, str], fn, args, usage) -> None:
    set_rank_env(rank, world_size, port, env)
    import datetime

    import torch
    import torch.distributed as dist

    from shiftlm.monitor import failure

    failure.set_reporter(lambda report: conn.send(("failure", report.to_dict())))
    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=1800)
        )
        conn.send(("ok", fn(*args)))
    except BaseException as err:  # noqa: BLE001 - every failure goes to the launcher, with its traceback
        report = failure.report_exception(rank, err, usage)
        conn.send(("failure", report.to_dict()))
        code = report.exit_code
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: a peer may be gone and destroy_process_group can block


def _stop(procs: list, grace_s: float) -> None:
    """SIGTERM every live process, then SIGKILL what is still there after `grace_s`."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    env: dict[str, str] | None = None,
    describe: Callable[[int], str] = lambda rank: "",
    usage: tuple[type[BaseException], ...] = (),
    settle_s: float = 1.0,
    grace_s: float = 3.0,
) -> Any:
    """Run `fn(*args)` once on `world_size` new gloo processes (as torchrun would); rank 0's result.

    The supervisor watches every rank at once (pipes and process sentinels). At the first failure (an
    exception, a process that died, a watchdog's hang report) it waits `settle_s` for the others'
    reports, stops every rank (SIGTERM, SIGKILL after `grace_s`) and raises `RankFailure` with the
    root cause: an exception over a death over a hang over a lost peer, earliest first."""
    from multiprocessing.connection import wait

    from shiftlm.monitor import failure

    ctx = mp.get_context("spawn")
    port = free_port()
    worker_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    conns, procs = [], []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_rank_main, args=(rank, world_size, port, child_conn, worker_env, fn, args, usage)
        )
        proc.start()
        child_conn.close()
        conns.append(parent_conn)
        procs.append(proc)
    results: dict[int, Any] = {}
    reports: list = []
    done: set[int] = set()
    first_failure: float | None = None
    forward = _Forward(procs)
    try:
        forward.__enter__()
        while len(done) < world_size:
            if first_failure is not None and time.monotonic() - first_failure > settle_s:
                break
            waiting = [r for r in range(world_size) if r not in done]
            handles = [conns[r] for r in waiting] + [procs[r].sentinel for r in waiting]
            for handle in wait(handles, timeout=0.2):
                rank = next(r for r in waiting if handle in (conns[r], procs[r].sentinel))
                if rank in done:
                    continue
                message = None
                if conns[rank].poll():
                    try:
                        message = conns[rank].recv()
                    except (EOFError, OSError):
                        message = None
                if message is not None and message[0] == "ok":
                    results[rank] = message[1]
                    done.add(rank)
                    continue
                if message is not None:
                    reports.append(failure.FailureReport(**message[1]))
                elif procs[rank].is_alive():
                    continue  # the pipe closed first; the sentinel follows
                else:
                    procs[rank].join()
                    reports.append(failure.report_exit(rank, procs[rank].exitcode))
                done.add(rank)
                if first_failure is None:
                    first_failure = time.monotonic()
    finally:
        forward.__exit__()
        _stop(procs, grace_s)
    if forward.received and (reports or 0 not in results):  # stopped before rank 0 could save
        raise Interrupted(forward.received)
    if not reports:
        return results.get(0)
    stopped = time.monotonic() - (first_failure or time.monotonic())
    root = min(reports, key=lambda r: failure.KINDS.index(r.kind))
    others = [r for r in reports if r is not root]
    raise RankFailure(root, others, stopped, describe)
