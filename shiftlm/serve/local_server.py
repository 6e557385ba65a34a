"""Start `shiftlm serve` as a child process on a free loopback port, wait until healthy, stop it after.

Used by `shiftlm bench serve --model`, bench/serve_modes.py and the live-server tests, so that all of
them exercise the real command line, processes and HTTP stack.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

from shiftlm.launch import free_port


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"shiftlm serve exited with code {proc.returncode} before it was healthy")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        time.sleep(0.2)
    raise TimeoutError(f"shiftlm serve at {url} was not healthy within {timeout:.0f}s")


@contextlib.contextmanager
def local_server(serve_args: list[str], timeout: float = 120.0, log_path: str | None = None) -> Iterator[str]:
    """`with local_server(["--model", d, "--tp", "2"]) as url:` -> "http://127.0.0.1:PORT"."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "shiftlm.cli",
        "serve",
        *serve_args,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    log = open(log_path or os.devnull, "w")  # noqa: SIM115 - closed below, after the process
    proc = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)  # uvicorn shuts down gracefully and rank 0 stops the workers
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
