"""`shiftlm serve`: start the ranks, load the model into the SP x TP layout, serve HTTP on rank 0.

    shiftlm serve --model DIR --tp 2 --sp 2 --shift-threshold 64 --port 8000

Without torchrun the command starts the other tp*sp - 1 ranks itself (local gloo processes); under
`torchrun --nproc-per-node tp*sp -m shiftlm.cli serve ...` every process runs this same function and
takes its rank from the environment. Rank 0 runs uvicorn, the scheduler and sampling; the others run
`ModelRunner.serve_steps` until rank 0 shuts down.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
from dataclasses import dataclass

from shiftlm.launch import free_port


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

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeOptions:
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})


def _init_distributed(rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if world_size > 1:
        # plans and logits are small; a long timeout lets rank 0 idle between requests
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(days=1))


def _worker_main(rank: int, world_size: int, port: int, options: ServeOptions) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    _init_distributed(rank, world_size)
    _load_runner(options).serve_steps()


def _load_runner(options: ServeOptions):
    from shiftlm.config import ParallelConfig
    from shiftlm.mesh import Mesh
    from shiftlm.serve.runner import ModelRunner

    mesh = Mesh(ParallelConfig(tp=options.tp, sp=options.sp))
    return ModelRunner.load(options.model, mesh, options.num_blocks, options.block_size)


def build_engine(runner, options: ServeOptions, tokenizer):
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
    return Engine(runner, scheduler_config, tokenizer, {e for e in eos if e is not None}, config.vocab_size)


def check_options(options: ServeOptions):
    """Fail before any process starts: the checkpoint, the layout and the tokenizer. Returns the tokenizer."""
    from shiftlm.config import ConfigError, ModelConfig, ParallelConfig
    from shiftlm.serve.tokenizer import load_tokenizer

    ParallelConfig(tp=options.tp, sp=options.sp).check_model(ModelConfig.from_hf(options.model))
    if options.mode not in ("tp", "sp_tp", "shift"):
        raise ConfigError(f"--mode {options.mode!r} is not one of tp, sp_tp, shift")
    return load_tokenizer(options.model)


def run_server(options: ServeOptions) -> int:
    """Start (or join) the ranks and serve until interrupted; returns the exit code."""
    world_size = options.tp * options.sp
    tokenizer = check_options(options) if int(os.environ.get("RANK", "0")) == 0 else None
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    workers = []
    if under_torchrun:
        rank = int(os.environ["RANK"])
        _init_distributed(rank, int(os.environ["WORLD_SIZE"]))
    else:
        rank, port = 0, free_port()
        ctx = mp.get_context("spawn")
        for worker_rank in range(1, world_size):
            proc = ctx.Process(
                target=_worker_main, args=(worker_rank, world_size, port, options), daemon=True
            )
            proc.start()
            workers.append(proc)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        _init_distributed(0, world_size)
    runner = _load_runner(options)
    if rank != 0:
        runner.serve_steps()
        return 0
    import uvicorn

    from shiftlm.serve.api import build_app
    from shiftlm.serve.async_engine import AsyncEngine

    engine = AsyncEngine(build_engine(runner, options, tokenizer), max_pending=options.max_pending)
    name = options.model_name or os.path.basename(os.path.normpath(options.model))
    app = build_app(engine, tokenizer, name)
    print(
        f"shiftlm serve: {name} on http://{options.host}:{options.port} "
        f"(tp={options.tp} sp={options.sp} mode={options.mode} threshold={options.shift_threshold})",
        flush=True,
    )
    try:
        uvicorn.run(app, host=options.host, port=options.port, log_level="warning")
    finally:
        engine.shutdown()
        if engine.error is None:
            runner.stop_workers()
        for proc in workers:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return 0
