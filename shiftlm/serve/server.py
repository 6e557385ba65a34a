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
import logging
import os
import signal
import socket
import sys
import threading
import time

from shiftlm.errors import EXIT_INTERRUPTED, EXIT_TEMPFAIL, ConfigError, error_line
from shiftlm.parallel import ParallelConfig
from shiftlm.serve.options import ServeOptions, ServeSetup
from shiftlm.serve.worker.start import freeze_startup_objects, start_ranks, stop_local_ranks

EXIT_RANK_FAILURE = EXIT_TEMPFAIL  # 75, as training exits for a dead peer: worth a restart
FAILED_HEALTH_SECONDS = 2.0  # after a rank failure, /health says 503 this long before the exit
log = logging.getLogger("shiftlm.serve")


def measure_shift_threshold(runner, setup: ServeSetup) -> ServeSetup:
    """Rank 0, before the engine starts: `--shift-threshold auto` becomes a token count, measured on
    every rank through the runner when a shift group has SP > 1 (worker/shift_probe.py); with SP = 1
    both modes are the same computation and the default 64 stands."""
    if not setup.measure_shift_threshold:
        return setup
    from shiftlm.serve.worker.shift_probe import measure_shift_threshold as probe

    scheduler = setup.scheduler
    threshold, _ = probe(
        runner.execute, scheduler.max_tokens_per_step, scheduler.block_size, scheduler.num_blocks
    )
    return setup.with_shift_threshold(threshold)


def build_engine(runner, setup: ServeSetup, step_log=None):
    """The engine on rank 0, sized from the resolved scheduler options."""
    from shiftlm.serve.engine.core import Engine

    engine = Engine(
        runner,
        setup.scheduler,
        setup.tokenizer,
        set(setup.eos_token_ids),
        setup.model_config.vocab_size,
        step_log=step_log,
        sliding_window=setup.model_config.sliding_window,
        async_scheduling=setup.flags.async_scheduling,
        json_any_whitespace=setup.flags.structured_outputs_any_whitespace,
    )
    if setup.model_config.is_moe:  # each step's rows per expert: /metrics and the step log
        runner.on_expert_rows = engine.metrics.record_expert_rows
    return engine


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


def run_server(options: ServeOptions) -> int:
    """Resolve the options, start (or join) the ranks and serve until interrupted; the exit code."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    setup = options.resolve()
    http = bind_http(options.host, options.port) if setup.rank == 0 else None
    try:
        runner, workers = start_ranks(setup.runner, setup.rank, setup.under_torchrun)
    except Exception as err:  # e.g. a rank died during rendezvous: say so in one line (the rest stopped)
        print(error_line("serve", f"failed to start: {err}"), file=sys.stderr, flush=True)
        return 1
    try:
        if setup.scheduler is None:  # a GPU cache sized by the ranks from what memory left
            setup = setup.with_kv_blocks(runner.cache.num_blocks)
    except ConfigError as err:
        print(error_line("serve", str(err)), file=sys.stderr, flush=True)
        if setup.rank == 0:
            runner.stop_workers()
        stop_local_ranks(workers)
        return err.exit_code
    if setup.rank != 0:
        freeze_startup_objects()
        runner.serve_steps()
        return 0
    with contextlib.ExitStack() as stack:
        step_log = stack.enter_context(open(options.step_log, "w", buffering=1)) if options.step_log else None
        code = _serve_http(runner, setup, http, step_log, workers)
    stop_local_ranks(workers)
    return code


def _serve_http(runner, setup: ServeSetup, http: socket.socket, step_log, workers) -> int:
    from shiftlm.serve.engine.async_engine import AsyncEngine
    from shiftlm.serve.engine.metrics import StatsLogger
    from shiftlm.serve.http.app import build_app
    from shiftlm.serve.http.uvicorn_server import (
        ConnectionGuard,
        QuietServer,
        auto_max_connections,
        uvicorn_config,
    )
    from shiftlm.serve.worker.ranks import RankMonitor

    failure: list[str] = []
    options = setup.flags

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

    setup = measure_shift_threshold(runner, setup)
    monitor = RankMonitor(workers, options.rank_timeout, options.step_timeout)
    engine = AsyncEngine(
        build_engine(runner, setup, step_log),
        max_pending=options.max_pending,
        multi_rank=setup.world_size > 1,
        on_fatal=on_fatal,
        diagnose=monitor.check,
    )
    api = setup.api
    app = build_app(engine, setup.tokenizer, api)
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
    monitor.start(engine.step_running_for, engine.fail)
    stats = StatsLogger(engine, log)
    ticker = threading.Thread(target=_tick, args=(stats, options.log_interval, server), daemon=True)
    ticker.start()
    host, port = http.getsockname()[:2]
    scheduler = setup.scheduler
    layout = (setup.parallel, options.mode, scheduler.policy.threshold, scheduler.max_tokens_per_step)
    freeze_startup_objects()
    if options.trust_remote_code:
        print("shiftlm serve: --trust-remote-code has no effect (shiftlm runs only its own model code)")
    print(
        f"shiftlm serve: {api.model_name} on http://{host}:{port} ({describe_layout(*layout)}, "
        f"max_model_len={engine.max_model_len}; {setup.describe_kv_cache()})",
        flush=True,
    )
    if api.sampling_defaults:
        print(f"shiftlm serve: {setup.flags.generation_defaults().describe()}", flush=True)
    if scheduler.speculative is not None:
        print(f"shiftlm serve: {scheduler.speculative.describe()}", flush=True)
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


def describe_layout(parallel: ParallelConfig, mode: str, threshold: float, max_tokens_per_step: int) -> str:
    """The banner's words for what will run: the layout and, for shift, what the threshold means
    (issue 36.5: after a probe that found SP x TP never faster, "mode=shift threshold=256" read as if
    steps would shift, and "full TP" after --tp 1 meant tp x sp ranks)."""
    tp, sp = parallel.tp, parallel.sp
    ranks, budget = tp * sp, max_tokens_per_step
    layout = f"tp={tp} sp={sp}, {ranks} rank{'s' if ranks > 1 else ''}"
    full_tp = f"full TP (all {ranks} ranks split every token's weights: tp x sp = {tp} x {sp})"
    if ranks == 1:
        return f"{layout}: one rank runs every step"
    if mode == "tp":
        return f"{layout}: every step runs {full_tp}"
    if mode == "sp_tp":
        return f"{layout}: every step runs SP x TP (tokens split {sp} ways, weights {tp} ways)"
    if sp == 1:
        return f"{layout}: sp=1, so every step runs TP over the {ranks} ranks"
    if threshold >= budget:
        return (
            f"{layout}: every step runs {full_tp}; SP x TP would start above threshold={threshold} "
            f"tokens and a step holds at most {budget} (--max-tokens-per-step)"
        )
    return (
        f"{layout}: mode=shift threshold={threshold}: steps of at most {threshold} tokens run {full_tp}, "
        f"larger ones SP x TP (tokens split {sp} ways)"
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
