"""`shiftlm serve`: start the ranks, load the model into the SP x TP layout, serve HTTP on rank 0.

    shiftlm serve --model DIR --tp 2 --sp 2 --shift-threshold 64 --port 8000

Without torchrun the command starts the other tp*sp - 1 ranks itself (local gloo processes); under
`torchrun --nproc-per-node tp*sp -m shiftlm.cli serve ...` every process runs this same function and
takes its rank from the environment. Rank 0 runs uvicorn, the scheduler and sampling; the others run
`ModelRunner.serve_steps` until rank 0 shuts down.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import multiprocessing as mp
import os
import socket
import sys
from dataclasses import dataclass

from shiftlm.config import ConfigError

# A rank that dies during startup must fail the others within minutes. Waiting for the next plan while
# the server idles uses the runner's own group, with a timeout of days (runner.PLAN_WAIT_TIMEOUT).
STARTUP_TIMEOUT = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class ServeOptions:
    model: str
    tp: int = 1
    sp: int = 1
    mode: str = "shift"
    shift_threshold: int = 64
    num_blocks: int = 256
    block_size: int = 16
    max_num_seqs: int = 64
    max_tokens_per_step: int = 256
    max_pending: int = 512
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None
    step_log: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeOptions:
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})


def _init_distributed(rank: int, world_size: int, store=None) -> None:
    """Join the gloo group: through `store` (local ranks) or torchrun's environment (store=None)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if world_size > 1:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, store=store, timeout=STARTUP_TIMEOUT
        )


def _local_store(world_size: int, port: int = 0):
    """The rendezvous store of the local ranks. Rank 0 (port 0) lets the OS pick a free port while
    binding it, so no other server, test or HTTP socket can take it in between (no free_port race)."""
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", port, world_size, is_master=port == 0, timeout=STARTUP_TIMEOUT, wait_for_workers=False
    )


def _worker_main(rank: int, world_size: int, store_port: int, options: ServeOptions) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        _init_distributed(rank, world_size, _local_store(world_size, store_port))
        runner = _load_runner(options)
    except Exception as err:  # one clear line; rank 0 sees this rank exit and stops too
        print(f"error: shiftlm serve rank {rank} failed to start: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
    runner.serve_steps()


def _load_runner(options: ServeOptions):
    from shiftlm.config import ParallelConfig
    from shiftlm.mesh import Mesh
    from shiftlm.serve.runner import ModelRunner

    mesh = Mesh(ParallelConfig(tp=options.tp, sp=options.sp))
    return ModelRunner.load(options.model, mesh, options.num_blocks, options.block_size)


def build_engine(runner, options: ServeOptions, tokenizer, step_log=None):
    """The engine on rank 0, sized from the runner's cache and the model's context length."""
    from shiftlm.serve.engine import Engine
    from shiftlm.serve.scheduler import SchedulerConfig, ShiftPolicy

    config = runner.model_config
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    scheduler_config = SchedulerConfig(
        num_blocks=options.num_blocks,
        block_size=options.block_size,
        max_num_seqs=options.max_num_seqs,
        max_tokens_per_step=options.max_tokens_per_step,
        max_model_len=min(config.max_position_embeddings, options.num_blocks * options.block_size),
        policy=ShiftPolicy.named(options.mode, options.shift_threshold),
    )
    eos_ids = {e for e in eos if e is not None}
    return Engine(runner, scheduler_config, tokenizer, eos_ids, config.vocab_size, step_log=step_log)


def check_options(options: ServeOptions):
    """Fail before any process starts: the checkpoint, the layout and the tokenizer. Returns the tokenizer."""
    from shiftlm.config import ModelConfig, ParallelConfig
    from shiftlm.serve.tokenizer import load_tokenizer

    ParallelConfig(tp=options.tp, sp=options.sp).check_model(ModelConfig.from_hf(options.model))
    if options.mode not in ("tp", "sp_tp", "shift"):
        raise ConfigError(f"--mode {options.mode!r} is not one of tp, sp_tp, shift")
    return load_tokenizer(options.model)


def bind_http(host: str, port: int) -> socket.socket:
    """Bind the HTTP socket before any rank starts, so a taken port fails at once and port 0 picks one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port} ({err.strerror}); choose another --port (0 picks a free one)"
        ) from None
    return sock


def _start_local_ranks(options: ServeOptions) -> list:
    """Spawn ranks 1..P-1 as local processes and join them as rank 0."""
    world_size = options.tp * options.sp
    if world_size == 1:
        return []
    store = _local_store(world_size)
    ctx = mp.get_context("spawn")
    workers = [
        ctx.Process(target=_worker_main, args=(rank, world_size, store.port, options), daemon=True)
        for rank in range(1, world_size)
    ]
    for proc in workers:
        proc.start()
    _init_distributed(0, world_size, store)
    return workers


def run_server(options: ServeOptions) -> int:
    """Start (or join) the ranks and serve until interrupted; returns the exit code."""
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ["RANK"]) if under_torchrun else 0
    tokenizer = check_options(options) if rank == 0 else None
    http = bind_http(options.host, options.port) if rank == 0 else None
    workers = []
    try:
        if under_torchrun:
            _init_distributed(rank, int(os.environ["WORLD_SIZE"]))
        else:
            workers = _start_local_ranks(options)
        runner = _load_runner(options)
    except Exception as err:  # e.g. a rank died during rendezvous: say so in one line, stop the rest
        print(f"error: shiftlm serve failed to start: {err}", file=sys.stderr, flush=True)
        _stop(workers)
        return 1
    if rank != 0:
        runner.serve_steps()
        return 0
    with contextlib.ExitStack() as stack:
        step_log = stack.enter_context(open(options.step_log, "w")) if options.step_log else None
        _serve_http(runner, options, tokenizer, http, step_log)
    _stop(workers)
    return 0


def _serve_http(runner, options: ServeOptions, tokenizer, http: socket.socket, step_log) -> None:
    import uvicorn

    from shiftlm.serve.api import build_app
    from shiftlm.serve.async_engine import AsyncEngine

    engine = AsyncEngine(build_engine(runner, options, tokenizer, step_log), max_pending=options.max_pending)
    name = options.model_name or os.path.basename(os.path.normpath(options.model))
    host, port = http.getsockname()[:2]
    print(
        f"shiftlm serve: {name} on http://{host}:{port} "
        f"(tp={options.tp} sp={options.sp} mode={options.mode} threshold={options.shift_threshold})",
        flush=True,
    )
    try:
        uvicorn.Server(uvicorn.Config(app=build_app(engine, tokenizer, name), log_level="warning")).run(
            sockets=[http]
        )
    finally:
        engine.shutdown()
        if engine.error is None:
            runner.stop_workers()


def _stop(workers: list) -> None:
    for proc in workers:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
