"""Run a function on N local gloo ranks (CPU processes), and keep the ranks for the next call.

Tests and `shiftlm verify` use this instead of torchrun: starting a process group costs seconds on a
2-core machine, so a `LocalWorkers` pool initialises torch.distributed once and then runs any number
of module-level functions, in lock-step on every rank. A function that raises on any rank, or takes
longer than `timeout`, fails the call with that rank's traceback instead of hanging.

    with LocalWorkers(4) as workers:
        results = workers.run(my_module.check_layout, tp=2, sp=2)   # one result per rank
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class WorkerError(RuntimeError):
    """A function failed (or timed out) on one of the local ranks."""


def _worker_main(rank: int, world_size: int, port: int, conn, env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    while True:
        message = conn.recv()
        if message is None:
            break
        fn, args, kwargs = message
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:  # report everything, including assertion errors, to the parent
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()
    conn.close()


class LocalWorkers:
    """A pool of `world_size` processes joined in one gloo process group."""

    def __init__(self, world_size: int, timeout: float = 300.0, env: dict[str, str] | None = None):
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
                args=(rank, world_size, port, child_conn, worker_env),
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

    def close(self, force: bool = False) -> None:
        for conn, proc in zip(self._conns, self._procs):
            if proc.is_alive() and not force:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
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
