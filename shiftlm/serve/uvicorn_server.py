"""uvicorn as `shiftlm serve` runs it: one access-log line per request, no shutdown chatter, and
SIGINT/SIGTERM end the server with exit code 0.

uvicorn re-raises a captured SIGINT after its graceful shutdown, so a plain `uvicorn.Server` turns
Ctrl-C into a KeyboardInterrupt traceback and exit code 1 (issue 10); `QuietServer` keeps the signals
it caught in `captured_signals` for the server's final line instead.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import uvicorn

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def uvicorn_config(app, shutdown_timeout: float) -> uvicorn.Config:
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
    return uvicorn.Config(app=app, log_config=log_config, timeout_graceful_shutdown=shutdown_timeout)


class QuietServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_signal=None):
        super().__init__(config)
        self.on_signal = on_signal  # called once, on the first SIGINT/SIGTERM

    def handle_exit(self, sig, frame) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first and self.on_signal is not None:
            self.on_signal()

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
