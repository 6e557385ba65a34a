"""`shiftlm serve`: start the ranks, load the model into the SP x TP layout, serve HTTP on rank 0.

    shiftlm serve DIR --tp 2 --sp 2 --shift-threshold 64 --port 8000

Without torchrun the command starts the other tp*sp - 1 ranks itself (local gloo processes, their
rendezvous store listening on loopback only); under `torchrun --nproc-per-node tp*sp -m shiftlm.cli
serve ...` every process runs this same function and takes its rank from the environment. Rank 0 runs
uvicorn, the scheduler and sampling; the others run `ModelRunner.serve_steps` until rank 0 stops them.

Exit codes: 0 after SIGTERM and 130 after SIGINT (Ctrl-C), as shells report an interrupted command
(in-flight requests drain for --shutdown-timeout seconds, then are aborted and every connection is
closed; one line says so), 2 for a bad flag, 3 for a bad checkpoint, 1 for a failed start, and
`EXIT_RANK_FAILURE` (75, as training uses for a dead peer) when a rank died or stalled while serving,
so that a supervisor restarts the server (docs/serving.md, "Operations").
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from shiftlm.config import ConfigError, error_line
from shiftlm.serve.options import ServeOptions

# A rank that dies during startup must fail the others within minutes. Waiting for the next plan while
# the server idles uses the runner's own group, with a timeout of days (runner.PLAN_WAIT_TIMEOUT); a
# stalled rank is caught by the rank monitor (serve/ranks.py) in seconds instead.
STARTUP_TIMEOUT = datetime.timedelta(minutes=5)
EXIT_RANK_FAILURE = 75
EXIT_INTERRUPTED = 130  # 128 + SIGINT
FAILED_HEALTH_SECONDS = 2.0  # after a rank failure, /health says 503 this long before the exit
log = logging.getLogger("shiftlm.serve")
_LISTENERS: list[socket.socket] = []


def pin_local_rank(local_rank: int, local_world_size: int) -> int | None:
    """Pin this thread (and the threads it starts: gloo's, the engine's, uvicorn's) to one core: local
    rank r on the r-th core of the process's affinity set (what `taskset` gave it), when that set has a
    core for every local rank. Returns the core, or None (fewer cores than ranks: left to the kernel).
    Unpinned, the kernel moves two ranks of a 2-core server onto one core at times, and every
    collective then waits for a descheduled peer (docs/serving.md, "Waiting ranks")."""
    cores = sorted(os.sched_getaffinity(0))
    if local_world_size < 2 or len(cores) < local_world_size:
        return None
    os.sched_setaffinity(0, {cores[local_rank]})
    return cores[local_rank]


def _init_distributed(
    rank: int, world_size: int, device: str, store=None, cpu_bind: str = "none", spin_wait: float = 0.0
) -> None:
    """Join the group (NCCL on GPUs, gloo on the CPU: `mesh.choose_device`): through `store` (local
    ranks, all on this node: rank r takes GPU r) or torchrun's environment (store=None). CPU ranks are
    pinned first (`cpu_bind="auto"`), so that gloo's threads start on the rank's core, and poll their
    collectives for `spin_wait` seconds before sleeping in them (`comm/wait.py`)."""
    import torch
    import torch.distributed as dist

    from shiftlm.comm.wait import set_spin_wait
    from shiftlm.mesh import choose_device

    if store is not None:
        os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    device_kind, backend = choose_device(device)
    if device_kind.type == "cpu":
        # Rank 0 also runs the HTTP thread: a poll there holds the GIL between yields and starved
        # uvicorn (32 concurrent streams: TTFT 0.6 -> 5 s), so only the ranks without one poll.
        set_spin_wait(spin_wait if rank != 0 else 0.0)
        if cpu_bind == "auto":
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            pin_local_rank(int(os.environ.get("LOCAL_RANK", rank)), local_world)
    torch.set_num_threads(1)
    if world_size > 1:
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, store=store, timeout=STARTUP_TIMEOUT
        )


def _local_store(world_size: int, port: int = 0):
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


def _freeze_startup_objects() -> None:
    """Move everything start-up made (the model, tokenizer, app, torch's and transformers' modules) out
    of the garbage collector's reach: a full collection then scans only what serving allocates. With
    them in, the full collections that serving's allocations trigger cost ~0.2 s each (measured: one
    round in five of the 32-concurrent bench load lost 0.19 s, its step gap 1.3 -> 2.7 ms). As vLLM
    does after its engine starts."""
    gc.collect()
    gc.freeze()


def _worker_main(
    rank: int, world_size: int, store_port: int, options: ServeOptions, clock, parent: int
) -> None:
    from shiftlm.serve.ranks import start_heartbeat

    # Ctrl-C reaches the whole process group: rank 0 alone decides when the workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ["OMP_NUM_THREADS"] = "1"
    start_heartbeat(clock, parent)
    try:
        store = _local_store(world_size, store_port)
        _init_distributed(rank, world_size, options.device, store, options.cpu_bind, options.spin_wait)
        runner = _load_runner(options)
    except Exception as err:  # one clear line; rank 0 sees this rank exit and stops too
        print(error_line("serve", f"rank {rank} failed to start: {err}"), file=sys.stderr, flush=True)
        sys.exit(1)
    _freeze_startup_objects()
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


def _load_runner(options: ServeOptions):
    import torch

    from shiftlm.mesh import Mesh, choose_device
    from shiftlm.serve.runner import ModelRunner

    if options.seed is not None:
        torch.manual_seed(options.seed)
    device = choose_device(options.device)[0]  # the process group's device (or this process's, alone)
    mesh = Mesh(options.parallel, device=device)
    dtype = getattr(torch, options.torch_dtype(device.type))
    # tests set SHIFTLM_ENFORCE_EAGER=1 (tests/conftest.py): no compile in every server they start
    eager = options.enforce_eager or os.environ.get("SHIFTLM_ENFORCE_EAGER") == "1"
    return ModelRunner.load(
        options.model,
        mesh,
        options.num_blocks,
        options.block_size,
        dtype=dtype,
        compile_decode=not eager,
        attention_backend=options.attention_backend,
    )


def resolve_shift_threshold(runner, options: ServeOptions) -> ServeOptions:
    """Rank 0, before the engine starts: `--shift-threshold auto` becomes a token count, measured on
    every rank through the runner when a shift group has SP > 1 (serve/shift_probe.py); with SP = 1
    both modes are the same computation and 64 stands."""
    if options.shift_threshold != "auto":
        return options
    threshold = 64
    if options.mode == "shift" and options.sp > 1:
        from shiftlm.serve.shift_probe import measure_shift_threshold

        threshold, _ = measure_shift_threshold(
            runner.execute, options.max_tokens_per_step, options.block_size, options.num_blocks
        )
    return dataclasses.replace(options, shift_threshold=threshold)


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
        max_model_len=options.context_length(config.max_position_embeddings),
        policy=ShiftPolicy.named(options.mode, options.shift_threshold),
        enable_prefix_caching=options.enable_prefix_caching,
    )
    eos_ids = {e for e in eos if e is not None}
    return Engine(runner, scheduler_config, tokenizer, eos_ids, config.vocab_size, step_log=step_log)


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


def _start_local_ranks(options: ServeOptions) -> list[tuple[int, object, object]]:
    """Spawn ranks 1..P-1 as local processes and join them as rank 0: [(rank, process, heartbeat)]."""
    world_size = options.tp * options.sp
    if world_size == 1:
        return []
    store = _local_store(world_size)
    ctx = mp.get_context("spawn")
    workers = []
    for rank in range(1, world_size):
        clock = ctx.Value("d", 0.0, lock=False)
        args = (rank, world_size, store.port, options, clock, os.getpid())
        workers.append((rank, ctx.Process(target=_worker_main, args=args, daemon=True), clock))
    for _, proc, _ in workers:
        proc.start()
    _init_distributed(0, world_size, options.device, store, options.cpu_bind, options.spin_wait)
    return workers


def run_server(options: ServeOptions) -> int:
    """Start (or join) the ranks and serve until interrupted; returns the exit code."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ["RANK"]) if under_torchrun else 0
    tokenizer = options.check() if rank == 0 else None
    http = bind_http(options.host, options.port) if rank == 0 else None
    workers = []
    try:
        if under_torchrun:
            world = int(os.environ["WORLD_SIZE"])
            _init_distributed(rank, world, options.device, None, options.cpu_bind, options.spin_wait)
        else:
            workers = _start_local_ranks(options)
        runner = _load_runner(options)
    except Exception as err:  # e.g. a rank died during rendezvous: say so in one line, stop the rest
        print(error_line("serve", f"failed to start: {err}"), file=sys.stderr, flush=True)
        _stop([proc for _, proc, _ in workers])
        return 1
    if rank != 0:
        _freeze_startup_objects()
        runner.serve_steps()
        return 0
    with contextlib.ExitStack() as stack:
        step_log = stack.enter_context(open(options.step_log, "w", buffering=1)) if options.step_log else None
        code = _serve_http(runner, options, tokenizer, http, step_log, workers)
    _stop([proc for _, proc, _ in workers])
    return code


def _serve_http(runner, options: ServeOptions, tokenizer, http: socket.socket, step_log, workers) -> int:
    from shiftlm.serve.api import ApiOptions, build_app
    from shiftlm.serve.async_engine import AsyncEngine
    from shiftlm.serve.metrics import StatsLogger
    from shiftlm.serve.ranks import RankMonitor
    from shiftlm.serve.uvicorn_server import (
        ConnectionGuard,
        QuietServer,
        auto_max_connections,
        uvicorn_config,
    )

    failure: list[str] = []
    world_size = options.tp * options.sp

    def on_fatal(reason: str) -> None:
        failure.append(reason)
        log.error(
            "%s; exiting with code %d so that a supervisor restarts the server", reason, EXIT_RANK_FAILURE
        )
        # /health answers 503 for a moment (probes see it, error responses flush), then the server
        # stops; the engine thread may sit in a collective that never returns, so it is not waited for
        threading.Timer(FAILED_HEALTH_SECONDS, lambda: setattr(server, "should_exit", True)).start()
        threading.Timer(
            FAILED_HEALTH_SECONDS + options.shutdown_timeout + 10, _hard_exit, args=(workers,)
        ).start()

    options = resolve_shift_threshold(runner, options)
    engine = AsyncEngine(
        build_engine(runner, options, tokenizer, step_log),
        max_pending=options.max_pending,
        multi_rank=world_size > 1,
        on_fatal=on_fatal,
    )
    api = ApiOptions(
        model_name=options.served_name(),
        api_key=options.resolved_api_key(),
        max_request_bytes=options.max_request_bytes,
        chat_template=options.chat_template_text(),
        step_timeout=options.step_timeout,
        body_timeout=options.body_timeout,
    )
    app = build_app(engine, tokenizer, api)
    guard = ConnectionGuard(options.max_connections or auto_max_connections(), options.header_timeout)
    config = uvicorn_config(
        app,
        options.shutdown_timeout + CUT_DELAY + CUT_GRACE,
        options.timeout_keep_alive,
        guard,
        access_log=not options.disable_log_requests,
    )

    # On SIGINT/SIGTERM, requests still running after --shutdown-timeout are aborted (their clients
    # get a 503 naming the shutdown) and every connection is cut (slow readers, stalled bodies), so
    # uvicorn never has to cancel a request mid-response and the exit keeps the promise.
    def drain_then_cut() -> None:
        engine.shutdown()
        time.sleep(CUT_DELAY)  # the aborted requests' handlers send their 503s and last SSE chunks
        server.cut_connections()

    drain = threading.Timer(options.shutdown_timeout, drain_then_cut)
    drain.daemon = True  # an idle server's Ctrl-C must not wait for it (issue 36.8: 5-7 s)
    server = QuietServer(config, on_signal=drain.start)
    monitor = RankMonitor(
        workers, engine.step_running_for, engine.fail, options.rank_timeout, options.step_timeout
    )
    engine.diagnose = monitor.check
    monitor.start()
    stats = StatsLogger(engine, log)
    ticker = threading.Thread(target=_tick, args=(stats, options.log_interval, server), daemon=True)
    ticker.start()
    host, port = http.getsockname()[:2]
    _freeze_startup_objects()
    if options.trust_remote_code:
        print("shiftlm serve: --trust-remote-code has no effect (shiftlm runs only its own model code)")
    print(
        f"shiftlm serve: {api.model_name} on http://{host}:{port} ({describe_layout(options)}, "
        f"max_model_len={engine.max_model_len})",
        flush=True,
    )
    server.run(sockets=[http])
    drain.cancel()
    monitor.stop()
    if failure:
        engine.shutdown(f"the engine stopped: {failure[0]}")
        _hard_exit(workers)
    aborted = engine.shutdown()
    runner.stop_workers()
    names = "/".join(signal.Signals(s).name for s in server.captured_signals) or "shutdown"
    print(f"shiftlm serve: stopped on {names}; {aborted} in-flight requests aborted", flush=True)
    return EXIT_INTERRUPTED if signal.SIGINT in server.captured_signals else 0


CUT_DELAY = 0.5  # seconds between aborting the requests left at --shutdown-timeout and cutting connections
CUT_GRACE = 1.0  # seconds after cutting the connections before uvicorn cancels what is left


def describe_layout(options: ServeOptions) -> str:
    """The banner's words for what will run: the layout and, for shift, what the threshold means
    (issue 36.5: after a probe that found SP x TP never faster, "mode=shift threshold=256" read as if
    steps would shift, and "full TP" after --tp 1 meant tp x sp ranks)."""
    ranks = options.tp * options.sp
    layout = f"tp={options.tp} sp={options.sp}, {ranks} rank{'s' if ranks > 1 else ''}"
    full_tp = (
        f"full TP (all {ranks} ranks split every token's weights: tp x sp = {options.tp} x {options.sp})"
    )
    if ranks == 1:
        return f"{layout}: one rank runs every step"
    if options.mode == "tp":
        return f"{layout}: every step runs {full_tp}"
    if options.mode == "sp_tp":
        return (
            f"{layout}: every step runs SP x TP (tokens split {options.sp} ways, weights {options.tp} ways)"
        )
    threshold = options.shift_threshold
    if options.sp == 1:
        return f"{layout}: sp=1, so every step runs TP over the {ranks} ranks"
    if threshold >= options.max_tokens_per_step:
        return (
            f"{layout}: every step runs {full_tp}; SP x TP would start above threshold={threshold} "
            f"tokens and a step holds at most {options.max_tokens_per_step} (--max-tokens-per-step)"
        )
    return (
        f"{layout}: mode=shift threshold={threshold}: steps of at most {threshold} tokens run {full_tp}, "
        f"larger ones SP x TP (tokens split {options.sp} ways)"
    )


def _tick(stats, interval: float, server) -> None:
    if interval <= 0:
        return
    stop = threading.Event()
    while not stop.wait(interval) and not server.should_exit:
        stats.tick()


def _hard_exit(workers) -> None:
    """Kill the workers and leave now with EXIT_RANK_FAILURE (threads may be stuck in collectives)."""
    for _, proc, _ in workers:
        with contextlib.suppress(Exception):
            proc.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_RANK_FAILURE)


def _stop(workers: list) -> None:
    for proc in workers:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


def default_served_name(model: str) -> str:
    """vLLM's default: the checkpoint's `_name_or_path` if its config.json has one, else `model` as given."""
    import json

    with contextlib.suppress(OSError, ValueError, AttributeError):
        name = json.loads((Path(model) / "config.json").read_text()).get("_name_or_path")
        if isinstance(name, str) and name.strip():
            return name.strip()
    return model
