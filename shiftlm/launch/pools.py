"""Local rank pools: N gloo ranks (CPU processes) started once, then any number of module-level
functions run on them in lock-step (tests, `shiftlm verify`, the benches)."""

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


def set_rank_env(rank: int, world_size: int, port: int, env: dict[str, str]) -> None:
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
    set_rank_env(rank, world_size, port, env)
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
