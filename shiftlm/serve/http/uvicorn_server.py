"""uvicorn as `shiftlm serve` runs it: one access-log line per request, no shutdown chatter, SIGTERM
ends the server with exit code 0 (SIGINT: the caller returns 130), and connections that cannot take
the server down.

uvicorn re-raises a captured SIGINT after its graceful shutdown, so a plain `uvicorn.Server` turns
Ctrl-C into a KeyboardInterrupt traceback and exit code 1 (issue 10); `QuietServer` keeps the signals
it caught in `captured_signals` for the server's final line instead.

Connection hygiene (issue 35.4): uvicorn times out only idle keep-alive connections, so 1,100 clients
that sent half a request held 1,100 file descriptors until the process hit its open-file limit and
nothing, `/health` included, was answered. `ConnectionGuard` closes a connection that has not sent
its request's headers within `header_timeout` seconds (the middleware bounds the body's time), keeps
at most `max_connections` open, below the open-file limit: a new connection past it closes the
oldest one still waiting for headers, or, when every connection is running a request, gets a fast
503 with Retry-After. One log line says when connections are refused or cut (at most every 10 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
import time
from collections.abc import Iterator

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
FD_RESERVE = 64  # descriptors kept for everything but connections (logs, the model, gloo's sockets)
LOG_EVERY = 10.0
log = logging.getLogger("shiftlm.serve")


def raise_open_file_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (as vLLM does at startup); return
    the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def auto_max_connections() -> int:
    """Connections that fit under the open-file limit next to what the process holds already."""
    soft = raise_open_file_limit()
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    open_now = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 64
    return max(16, soft - open_now - FD_RESERVE)


class ConnectionGuard:
    """The open connections of one server, oldest first; see the module docstring."""

    def __init__(self, max_connections: int, header_timeout: float):
        self.max_connections, self.header_timeout = max_connections, header_timeout
        self.open: dict[object, None] = {}  # insertion-ordered: oldest first
        self.refused = self.cut = 0
        self._logged = (0.0, 0, 0)
        self._sweeping = False

    def opened(self, protocol) -> bool:
        """Register a new connection; False when it must be refused (every other one is busy)."""
        self.open[protocol] = None
        self._sweep_soon(protocol.loop)
        if len(self.open) <= self.max_connections:
            return True
        idle = next((p for p in self.open if p is not protocol and not _busy(p)), None)
        if idle is None:
            del self.open[protocol]
            self.refused += 1
            self._log()
            return False
        self._close(idle)
        return True

    def closed(self, protocol) -> None:
        self.open.pop(protocol, None)

    def _close(self, protocol) -> None:
        self.open.pop(protocol, None)
        self.cut += 1
        protocol.transport.abort()
        self._log()

    def _sweep_soon(self, loop) -> None:
        if not self._sweeping:
            self._sweeping = True
            loop.call_later(1.0, self._sweep, loop)

    def _sweep(self, loop) -> None:
        """Close connections waiting for their request's headers past `header_timeout`."""
        self._sweeping = False
        now = time.monotonic()
        for protocol in list(self.open):
            if not _busy(protocol) and now - protocol.idle_since > self.header_timeout:
                self._close(protocol)
        if self.open:
            self._sweep_soon(loop)

    def _log(self) -> None:
        last, refused, cut = self._logged
        now = time.monotonic()
        if now - last >= LOG_EVERY:
            log.warning(
                "connections: %d refused with 503 (all %d busy, --max-connections) and %d closed "
                "(no request headers within --header-timeout %g s, or idle while the limit was reached) "
                "since the last such line",
                self.refused - refused,
                self.max_connections,
                self.cut - cut,
                self.header_timeout,
            )
            self._logged = (now, self.refused, self.cut)


def _busy(protocol) -> bool:
    """Whether the connection is running a request (its headers arrived, its response is not done)."""
    cycle = getattr(protocol, "cycle", None)
    return cycle is not None and not cycle.response_complete


REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)
REFUSED_BODY = (
    b'{"error": {"message": "too many open connections (--max-connections); retry later", '
    b'"type": "service_unavailable", "param": null, "code": 503}}'
)


def guarded_protocol(guard: ConnectionGuard) -> type:
    """uvicorn's HTTP protocol class with `guard` watching its connections."""

    class GuardedProtocol(AutoHTTPProtocol):
        def connection_made(self, transport) -> None:
            self.idle_since = time.monotonic()
            super().connection_made(transport)
            if not guard.opened(self):
                transport.write(REFUSED % (len(REFUSED_BODY), REFUSED_BODY))
                transport.close()

        def connection_lost(self, exc) -> None:
            guard.closed(self)
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            self.idle_since = time.monotonic()  # the next request's headers are timed from here
            super().on_response_complete()

    return GuardedProtocol


def uvicorn_config(
    app,
    shutdown_timeout: float,
    keep_alive_timeout: float = 5.0,
    guard: ConnectionGuard | None = None,
    access_log: bool = True,
) -> uvicorn.Config:
    log_config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "access": {
                "()": "uvicorn.logging.AccessFormatter",
                "fmt": '%(asctime)s INFO access: %(client_addr)s "%(request_line)s" %(status_code)s',
                "use_colors": False,
            },
        },
        "handlers": {
            "access": {"class": "logging.StreamHandler", "formatter": "access", "stream": "ext://sys.stdout"}
        },
        "loggers": {
            "uvicorn.access": {"handlers": ["access"], "level": "INFO", "propagate": False},
            "uvicorn.error": {"level": "WARNING"},
            "uvicorn": {"level": "WARNING"},
        },
    }
    return uvicorn.Config(
        app=app,
        log_config=log_config,
        access_log=access_log,
        timeout_graceful_shutdown=shutdown_timeout,
        timeout_keep_alive=keep_alive_timeout,
        http=guarded_protocol(guard) if guard is not None else "auto",
    )


class QuietServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_signal=None):
        super().__init__(config)
        self.on_signal = on_signal  # called once, on the first SIGINT/SIGTERM
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first and self.on_signal is not None:
            self.on_signal()

    def cut_connections(self) -> None:
        """From any thread: drop every open connection (slow readers, stalled bodies) so that the
        shutdown never waits on a client; their handlers see a disconnect and end without errors."""

        def cut() -> None:
            for connection in list(self.server_state.connections):
                transport = getattr(connection, "transport", None)
                if transport is not None:
                    transport.abort()

        if self.loop is not None and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(cut)

    @property
    def captured_signals(self) -> list[int]:
        return list(getattr(self, "_captured_signals", []))

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)
