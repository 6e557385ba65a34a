"""Start `shiftlm serve` as a child process on a free loopback port, wait until healthy, stop it after.

Used by `shiftlm bench serve --model`, bench/serve_modes.py and the live-server tests, so that all of
them exercise the real command line, processes and HTTP stack. The server is started with `--port 0`:
it binds a port the OS picks and prints it, so no other process can take the port in between.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_LISTENING = re.compile(r"shiftlm serve: .* on (http://[\w.:\[\]-]+:\d+) ")


@dataclass(frozen=True)
class LocalServer:
    url: str  # "http://127.0.0.1:PORT"
    pid: int  # rank 0: HTTP, scheduler and one model shard
    process: subprocess.Popen | None = None
    log_path: str | None = None

    def worker_pids(self) -> list[int]:
        """The local worker ranks (rank 0's child processes, in start order)."""
        children = Path(f"/proc/{self.pid}/task/{self.pid}/children")
        pids = [int(pid) for pid in children.read_text().split()] if children.exists() else []
        # spawn also starts a resource tracker: the ranks are the children that run spawn_main
        return [
            pid for pid in pids if b"spawn_main" in _cmdline(pid) and b"resource_tracker" not in _cmdline(pid)
        ]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


class ServerStartError(RuntimeError):
    """`shiftlm serve` exited or hung before it was healthy; the message ends with its log."""


def _log_tail(log_path: Path, lines: int = 20) -> str:
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def wait_healthy(proc: subprocess.Popen, log_path: Path, timeout: float) -> str:
    """Wait for the server's "on http://..." line, then for /health 200; return its URL."""
    deadline = time.monotonic() + timeout
    url = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(
                f"shiftlm serve exited with code {proc.returncode} before it was healthy; its log:\n"
                + _log_tail(log_path)
            )
        if url is None and (match := _LISTENING.search(log_path.read_text(errors="replace"))):
            url = match.group(1)
        if url is not None:
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return url
        time.sleep(0.2)
    raise ServerStartError(
        f"shiftlm serve was not healthy within {timeout:.0f}s; its log:\n" + _log_tail(log_path)
    )


@contextlib.contextmanager
def local_server(
    serve_args: list[str], timeout: float = 300.0, log_path: str | None = None, preexec_fn=None
) -> Iterator[LocalServer]:
    """`with local_server(["--model", d, "--tp", "2"]) as server:` -> `server.url`, `server.pid`."""
    command = [
        sys.executable,
        "-m",
        "shiftlm.cli",
        "serve",
        *serve_args,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
    ]
    with contextlib.ExitStack() as stack:
        if log_path is None:
            log_path = str(Path(stack.enter_context(tempfile.TemporaryDirectory())) / "serve.log")
        log = stack.enter_context(open(log_path, "w"))
        proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            preexec_fn=preexec_fn,  # e.g. a lower open-file limit (tests/chaos)
        )
        try:
            yield LocalServer(wait_healthy(proc, Path(log_path), timeout), proc.pid, proc, log_path)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # uvicorn shuts down gracefully and rank 0 stops the workers
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
