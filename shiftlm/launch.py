"""Run a function on N local gloo ranks (CPU processes), and keep the ranks for the next call.

Tests and `shiftlm verify` use this instead of torchrun: starting a process group costs seconds on a
2-core machine, so a `LocalWorkers` pool initialises torch.distributed once and then runs any number
of module-level functions, in lock-step on every rank. A function that raises on any rank, or takes
longer than `timeout`, fails the call with that rank's traceback instead of hanging.

    with LocalWorkers(4) as workers:
        results = workers.run(my_module.check_layout, tp=2, sp=2)   # one result per rank

`run_ranks` is the other mode, for `shiftlm train --nproc N`: one function, once, on N fresh
processes, supervised as torchrun's agent does: the first rank to fail is named with its own
traceback, the others are stopped within seconds, and the exit code says whether to restart
(`shiftlm.monitor.failure`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class WorkerError(RuntimeError):
    """A function failed (or timed out) on one of the local ranks."""


def _set_rank_env(rank: int, world_size: int, port: int, env: dict[str, str]) -> None:
    """The environment torchrun gives a local rank (env:// rendezvous on loopback), plus `env`."""
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )


def _worker_main(
    rank: int, world_size: int, port: int, conn, env: dict[str, str], backend: str = "gloo"
) -> None:
    _set_rank_env(rank, world_size, port, env)
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":  # one GPU per rank, as torchrun's LOCAL_RANK
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
    )
    while True:
        message = conn.recv()
        if message is None:
            break
        fn, args, kwargs = message
        before = set(_subgroups())
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:  # report everything, including assertion errors, to the parent
            conn.send(("error", traceback.format_exc()))
        # a task's meshes are gone with it: free their process groups (each gloo group holds threads
        # and sockets; a pool that runs hundreds of tasks would otherwise keep thousands of them)
        for group in set(_subgroups()) - before:
            dist.destroy_process_group(group)
    dist.destroy_process_group()
    conn.close()


def _subgroups() -> list:
    """The process groups other than the default one that this process holds."""
    from torch.distributed import distributed_c10d

    default = distributed_c10d._get_default_group()
    return [group for group in distributed_c10d._world.pg_map if group is not default]


class LocalWorkers:
    """A pool of `world_size` processes joined in one process group: gloo on the CPU, or `backend="nccl"`
    with rank i on GPU i."""

    def __init__(
        self,
        world_size: int,
        timeout: float = 300.0,
        env: dict[str, str] | None = None,
        backend: str = "gloo",
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        ctx = mp.get_context("spawn")
        port = free_port()
        self._conns = []
        self._procs = []
        worker_env = {"OMP_NUM_THREADS": "1", **(env or {})}
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, world_size, port, child_conn, worker_env, backend),
                daemon=True,
            )
            proc.start()
            self._conns.append(parent_conn)
            self._procs.append(proc)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call `fn(*args, **kwargs)` on every rank; return the per-rank results in rank order."""
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        results, errors = [], []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(self.timeout):
                self.close(force=True)
                raise WorkerError(f"rank {rank} did not finish {fn.__name__} within {self.timeout:.0f}s")
            status, payload = conn.recv()
            if status == "error":
                errors.append(f"--- rank {rank} ---\n{payload}")
            results.append(payload)
        if errors:
            raise WorkerError(f"{fn.__name__} failed:\n" + "\n".join(errors))
        return results

    def stop(self) -> None:
        """Tell every rank to leave its process group and exit, without waiting (`Pools.close` stops
        every pool before it waits for any; a second stop is harmless: an exited rank reads nothing)."""
        for conn, proc in zip(self._conns, self._procs):
            if proc.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass

    def close(self, force: bool = False) -> None:
        if not force:
            self.stop()
        for proc in self._procs:
            proc.join(timeout=0 if force else 10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._conns, self._procs = [], []

    def __enter__(self) -> LocalWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(force=exc[0] is not None)


class Pools:
    """`LocalWorkers` pools by world size, each started on first use and kept for the next call (the
    test suite's `ranks` fixture; `shiftlm verify`, whose layouts share a pool per rank count). A pool
    whose call failed is closed, since a failed collective can leave its group broken, and started
    afresh next time. `close` closes them all in the time of one: every rank of every pool is told to
    exit (each leaves its process group, ~1 s on 2 cores) before any is waited for."""

    def __init__(self, **options: Any):
        self.options = options  # LocalWorkers' keyword arguments (timeout, env, backend)
        self._pools: dict[int, LocalWorkers] = {}

    def get(self, world_size: int) -> LocalWorkers:
        pool = self._pools.get(world_size)
        if pool is None or not pool._procs:
            pool = self._pools[world_size] = LocalWorkers(world_size, **self.options)
        return pool

    def run(self, world_size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        try:
            return self.get(world_size).run(fn, *args, **kwargs)
        except WorkerError:
            self._pools.pop(world_size).close(force=True)
            raise

    def close(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.stop()
        for pool in pools:
            pool.close()

    def __enter__(self) -> Pools:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- one job on N fresh processes, supervised (`shiftlm train --nproc`) ------------------------------


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
    _set_rank_env(rank, world_size, port, env)
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
