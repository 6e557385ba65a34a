"""Starting a serving rank: join the process group, pin the core, load the runner.

    options = RunnerOptions(model="DIR", model_config=config, parallel=ParallelConfig(tp=2), ...)
    workers = start_local_ranks(options)   # rank 0, without torchrun: ranks 1..P-1 as local processes
    runner = load_runner(options)          # every rank

`serve/options.py` resolves the flags into these options once (device, dtype, model config, the
SHIFTLM_* environment); nothing here reads a flag or a config file again.

A local CPU (gloo) worker that dies while the ranks start (it raises, is killed, runs out of memory,
cannot import or unpickle its arguments) fails rank 0 at its next wait for the ranks, within a
fraction of a second, with `RankStartError` naming the rank and how it exited; the other workers are
killed, and a later start in the same process (a notebook's next `LLM`) begins afresh.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_for_exits

from shiftlm.config import ModelConfig
from shiftlm.errors import ConfigError, error_line
from shiftlm.parallel import ParallelConfig
from shiftlm.serve.worker.ranks import describe_exit

# A rank stuck during startup fails the others after this long (a local worker that exits fails them at
# once: `watched_store`). Waiting for the next plan while the server idles uses the runner's own group,
# with a timeout of days (runner.PLAN_WAIT_TIMEOUT); a stalled rank is caught by the rank monitor
# (worker/ranks.py) in seconds instead.
STARTUP_TIMEOUT = datetime.timedelta(minutes=5)
STORE_POLL = 0.05  # seconds between rank 0's looks at the store (and its workers) while it waits
# A collective that a worker's sudden death broke (SIGKILL, the OOM killer) raises on rank 0 a moment
# before that exit can be read (measured: under 1 ms). A worker that fails in Python prints its own
# line and takes ~0.7 s to exit: not waited for, so that rank 0's own error is never put on a worker.
EXIT_GRACE = 0.2
_LISTENERS: list[socket.socket] = []
# The Python side of rank 0's watched store (its methods), kept while groups made through it may call
# it: torch holds only its C++ side. The next start replaces it; a process's groups are gone by then.
_WATCHED_STORE: list = []


class RankStartError(RuntimeError):
    """A local worker rank died while the ranks were starting: which, and how it exited."""


@dataclass(frozen=True)
class RunnerOptions:
    """What every rank needs to build its runner: resolved, checked, picklable (spawned ranks get it)."""

    model: str
    model_config: ModelConfig
    parallel: ParallelConfig
    device: str  # "cpu" or "cuda" (`mesh.choose_device`, once): rank r of a node takes GPU r
    backend: str  # gloo or nccl
    dtype: str  # a torch dtype name: float32, bfloat16, float16
    num_blocks: int | None = 256  # None: as many as `gpu_memory_utilization` leaves (worker/kv_memory.py)
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    activation_bytes: int = 0  # a step's transient memory, kept free of the cache
    compile_decode: bool = False  # and, on CUDA, CUDA graphs of decode steps (worker/decode_graphs.py)
    max_num_seqs: int = 64  # the largest decode batch a CUDA graph is captured for
    cuda_graph_sizes: tuple[int, ...] = ()  # --cuda-graph-sizes (decode_graphs.capture_sizes)
    max_model_len: int | None = None  # the longest context a CUDA graph is captured for (None: the cache)
    attention_backend: str = "auto"
    shm_collectives: bool = True  # CPU ranks of one host: collectives through shared memory (comm/shm.py)
    seed: int | None = None
    cpu_bind: str = "auto"
    spin_wait: float = 0.0

    @property
    def world_size(self) -> int:
        return self.parallel.world_size


def pin_local_rank(local_rank: int, local_world_size: int) -> int | None:
    """Pin this thread (and the threads it starts: gloo's, the engine's, uvicorn's) to one core: local
    rank r on the r-th core of the process's affinity set (what `taskset` gave it), when that set has a
    core for every local rank. Returns the core, or None (fewer cores than ranks: left to the kernel).
    Unpinned, the kernel moves two ranks of a 2-core server onto one core at times, and every
    collective then waits for a descheduled peer (bench/results/serving_history.md, "Waiting ranks")."""
    cores = sorted(os.sched_getaffinity(0))
    if local_world_size < 2 or len(cores) < local_world_size:
        return None
    os.sched_setaffinity(0, {cores[local_rank]})
    return cores[local_rank]


def init_distributed(rank: int, options: RunnerOptions, store=None) -> None:
    """Join the group (NCCL on GPUs, gloo on the CPU, as resolved): through `store` (local ranks, all
    on this node: rank r takes GPU r) or torchrun's environment (store=None). CPU ranks are pinned
    first (`cpu_bind="auto"`), so that gloo's threads start on the rank's core, and poll their
    collectives for `spin_wait` seconds before sleeping in them (`comm/wait.py`)."""
    import torch
    import torch.distributed as dist

    from shiftlm.comm.wait import set_spin_wait

    world_size = options.world_size
    if store is not None:
        os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if options.device == "cuda":
        torch.cuda.set_device(local_rank)
    else:
        if options.cpu_bind == "auto":
            pin_local_rank(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        # Rank 0 also runs the HTTP thread: a poll there holds the GIL between yields and starved
        # uvicorn (32 concurrent streams: TTFT 0.6 -> 5 s), so only the ranks without one poll.
        set_spin_wait(options.spin_wait if rank != 0 else 0.0)
    torch.set_num_threads(1)
    if world_size > 1:
        dist.init_process_group(
            options.backend, rank=rank, world_size=world_size, store=store, timeout=STARTUP_TIMEOUT
        )


def local_store(world_size: int, port: int = 0):
    """The rendezvous store of the local ranks. Rank 0 binds a loopback socket itself (port 0: the OS
    picks a free one while binding, so nothing can take it in between) and hands it to the store, which
    would otherwise listen on every interface although only local processes ever connect."""
    import torch.distributed as dist

    kwargs = dict(timeout=STARTUP_TIMEOUT, wait_for_workers=False)
    if port:
        return dist.TCPStore("127.0.0.1", port, world_size, is_master=False, **kwargs)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    store = dist.TCPStore(
        "127.0.0.1",
        listener.getsockname()[1],
        world_size,
        is_master=True,
        master_listen_fd=listener.fileno(),
        **kwargs,
    )
    _LISTENERS.append(listener)  # the store serves on this fd: keep the socket object alive
    return store


def freeze_startup_objects() -> None:
    """Move everything start-up made (the model, tokenizer, app, torch's and transformers' modules) out
    of the garbage collector's reach: a full collection then scans only what serving allocates. With
    them in, the full collections that serving's allocations trigger cost ~0.2 s each (measured: one
    round in five of the 32-concurrent bench load lost 0.19 s, its step gap 1.3 -> 2.7 ms). As vLLM
    does after its engine starts."""
    gc.collect()
    gc.freeze()


def load_runner(options: RunnerOptions):
    """This rank's `ModelRunner` (after `init_distributed`)."""
    import torch

    from shiftlm.mesh import Mesh
    from shiftlm.serve.worker.runner import ModelRunner

    if options.seed is not None:
        torch.manual_seed(options.seed)
    if options.device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    return ModelRunner.load(
        options.model,
        Mesh(options.parallel, device=device),
        options.num_blocks,
        options.block_size,
        dtype=getattr(torch, options.dtype),
        compile_decode=options.compile_decode,
        attention_backend=options.attention_backend,
        model_config=options.model_config,
        shm_collectives=options.shm_collectives,
        memory=(options.gpu_memory_utilization, options.activation_bytes),
        max_num_seqs=options.max_num_seqs,
        max_model_len=options.max_model_len,
        cuda_graph_sizes=options.cuda_graph_sizes,
    )


def worker_main(rank: int, store_port: int, options: RunnerOptions, clock, parent: int) -> None:
    """A local rank > 0 that `shiftlm serve` started itself: run every plan rank 0 sends."""
    from shiftlm.serve.worker.ranks import start_heartbeat

    # Ctrl-C reaches the whole process group: rank 0 alone decides when the workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ["OMP_NUM_THREADS"] = "1"
    start_heartbeat(clock, parent)
    try:
        store = local_store(options.world_size, store_port)
        init_distributed(rank, options, store)
        runner = load_runner(options)
    except Exception as err:  # one clear line; rank 0 sees this rank exit and stops too
        print(error_line("serve", f"rank {rank} failed to start: {err}"), file=sys.stderr, flush=True)
        sys.exit(1)
    freeze_startup_objects()
    try:
        runner.serve_steps()
    except Exception as err:  # a peer died: rank 0's monitor names the failure; say why this one stops
        print(
            f"shiftlm serve rank {rank}: stopping ({type(err).__name__}: {err})", file=sys.stderr, flush=True
        )
        sys.exit(1)
    # Stopped cleanly by rank 0, which owns everything a user sees: leave without the interpreter's
    # teardown, where C++ destructors (gloo, oneDNN) intermittently printed "terminate called without
    # an active exception" into the server's log after its last line (tests/chaos, SIGTERM drain).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def start_ranks(options: RunnerOptions, rank: int, under_torchrun: bool):
    """Join (under torchrun) or start (ranks 1..P-1 as local processes) the serving ranks and load this
    rank's runner: (runner, [(rank, process, heartbeat)] of the local workers). On a failure the
    workers started are killed and the error is raised. Under torchrun a dead rank is torchrun's to
    handle (its agent stops the group)."""
    if under_torchrun:
        init_distributed(rank, options)
        return load_runner(options), []
    workers = start_local_ranks(options)
    with _undone_on_failure(workers, joined=bool(workers)):  # a single rank joins no group
        return load_runner(options), workers


def stop_local_ranks(workers: list, timeout: float = 10.0) -> None:
    """Wait for the local workers to leave (rank 0 sent them the stop message), killing stragglers."""
    for _, proc, _ in workers:
        proc.join(timeout=timeout)
        if proc.is_alive():
            proc.kill()


def start_local_ranks(options: RunnerOptions) -> list[tuple[int, object, object]]:
    """Spawn ranks 1..P-1 as local processes and join them as rank 0: [(rank, process, heartbeat)]."""
    world_size = options.world_size
    if world_size == 1:
        return []
    store = local_store(world_size)
    ctx = mp.get_context("spawn")
    workers = []
    with _undone_on_failure(workers, joined=False):
        with _caller_script_hidden():
            for rank in range(1, world_size):
                clock = ctx.Value("d", 0.0, lock=False)
                args = (rank, store.port, options, clock, os.getpid())
                proc = ctx.Process(target=worker_main, args=args, daemon=True)
                proc.start()
                workers.append((rank, proc, clock))
        # gloo's groups meet in the store (here and in every `new_group` of the load), so watching its
        # waits covers the whole start. An NCCL group keeps its store for life and polls it from a C++
        # thread, which must not call into Python: it gets the store itself (and meets later anyway).
        if options.backend == "gloo":
            store = watched_store(store, workers)
        init_distributed(0, options, store)
    _WATCHED_STORE[:] = [store]
    return workers


def watched_store(store, workers: list):
    """`store` for rank 0, with every wait a poll of the store that raises `RankStartError` as soon as
    a worker has exited: a rank that died before joining a group never sets its key, and the store's
    own wait would sit out the group's timeout (STARTUP_TIMEOUT; gloo's 30 minutes for `new_group`)."""
    import torch.distributed as dist

    class WatchedStore(dist.Store):
        def wait(self, keys, timeout=None):
            timeout = timeout or store.timeout
            deadline = time.monotonic() + timeout.total_seconds()
            pause = 0.001  # most keys are there already, or within milliseconds
            while not store.check(keys):
                failure = dead_worker(workers)
                if failure is not None:
                    raise failure
                if time.monotonic() > deadline:
                    raise dist.DistStoreError(
                        f"the ranks did not meet within {timeout} (rank 0 waited for {keys} in the store)"
                    )
                time.sleep(pause)
                pause = min(2 * pause, STORE_POLL)

        def get(self, key):
            self.wait([key])
            return store.get(key)

        # the rest as the store does them: torch calls a Python store's methods by name, and finds
        # none in a C++ function (`set = store.set` would raise "Not implemented")
        def set(self, key, value):
            store.set(key, value)

        def add(self, key, value):
            return store.add(key, value)

        def check(self, keys):
            return store.check(keys)

        def compare_set(self, key, expected, desired):
            return store.compare_set(key, expected, desired)

        def delete_key(self, key):
            return store.delete_key(key)

        def num_keys(self):
            return store.num_keys()

    return WatchedStore()


def dead_worker(workers: list, grace: float = 0.0) -> RankStartError | None:
    """The first local worker that has exited, as the error to raise (None: all live), waiting up to
    `grace` seconds for one to."""
    ended = wait_for_exits([proc.sentinel for _, proc, _ in workers], grace) if workers else []
    for rank, proc, _ in workers:
        if proc.sentinel in ended:
            proc.join()  # its sentinel closes with its files, a moment before its exit status is there
            how = describe_exit(proc.exitcode)
            return RankStartError(f"rank {rank} (pid {proc.pid}) died while the ranks were starting ({how})")
    return None


@contextlib.contextmanager
def _undone_on_failure(workers: list, joined: bool):
    """If the body raises, undo the start (`_undo_start`). A worker that died suddenly is named rather
    than the collective it broke ("connection reset by peer"); a `ConfigError`, which every rank meets
    alike, is left as rank 0 says it."""
    try:
        yield
    except Exception as err:
        cause = None if isinstance(err, (ConfigError, RankStartError)) else dead_worker(workers, EXIT_GRACE)
        _undo_start(workers, joined)
        if cause is None:
            raise
        raise cause from err
    except BaseException:
        _undo_start(workers, joined)
        raise


def _undo_start(workers: list, joined: bool) -> None:
    """Kill the workers (starting, they have nothing to drain) and leave torch.distributed as it was,
    so that the next start in this process meets its new workers: this start's group (`joined`) left
    behind, or the group count of a failed `init_process_group`, would name the next groups apart."""
    import torch.distributed as dist

    from shiftlm.comm import shm

    for _, proc, _ in workers:
        proc.kill()
        proc.join()
    if joined:  # as `LLM.close` leaves it
        shm.disable_all()
        dist.destroy_process_group()
    elif not dist.is_initialized():  # no group to count (a group there is the caller's own: kept)
        dist.distributed_c10d._world.group_count = 0


@contextlib.contextmanager
def _caller_script_hidden():
    """While the ranks start, `__main__` has no file and no module spec, so that multiprocessing's
    spawn does not re-run the caller's script in each rank: a script that builds `LLM(..., sp=2)` at
    top level, without an `if __name__ == "__main__":` guard (the README's example pasted into a
    file), would otherwise build it again in every child, which fails there, and rank 0 would wait
    out the rendezvous timeout. The ranks run `worker_main`, which needs nothing of the script."""
    main = sys.modules.get("__main__")
    saved = {name: getattr(main, name) for name in ("__file__", "__spec__") if hasattr(main, name)}
    try:
        for name in saved:
            setattr(main, name, None) if name == "__spec__" else delattr(main, name)
        yield
    finally:
        for name, value in saved.items():
            setattr(main, name, value)
