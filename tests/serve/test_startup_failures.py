"""A local worker rank that dies while the ranks start fails rank 0 within seconds, naming the rank and
how it exited, with the other workers stopped: never the rendezvous timeout (5 minutes; gloo's 30 for
a group the load makes). `shiftlm serve` exits non-zero with one line; the offline `LLM` raises, and
the same process can start another `LLM` afterwards.

The failures are real ones in the spawned worker: each offline scenario runs in a fresh process
(`offline_start`, timed out rather than hung on a regression) whose rank 1 runs a stand-in for
`worker_main` from this module, which breaks one step of the real worker and then runs it.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shiftlm.serve.engine.tokenizer import write_char_tokenizer
from shiftlm.serve.worker import start
from shiftlm.tools.tiny import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
QUICK = 60.0  # seconds: far under STARTUP_TIMEOUT (300), far over a start on a loaded 2-core machine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("startup") / "tiny", "llama-gqa")
    write_char_tokenizer(path, vocab_size=250)
    return path


def unreachable_store(rank, *args):
    """Rank 1 cannot connect to the rendezvous store: it prints its error line and exits 1 before
    joining the group, while the other workers wait in the rendezvous."""
    if rank == 1:

        def refuse(*_):
            raise ConnectionRefusedError("the rendezvous store refused the connection")

        start.local_store = refuse
    start.worker_main(rank, *args)


def unreadable_weights(rank, *args):
    """Rank 1 joins the group, then fails to load its weights (rank 0 goes on to the load's groups)."""

    def fail(_):
        raise OSError("model.safetensors: Input/output error")

    start.load_runner = fail
    start.worker_main(rank, *args)


def killed_in_a_collective(rank, *args):
    """Rank 1 loads, then is killed (as by the OOM killer) where the ranks exchange through gloo while
    making their shared-memory channel: rank 0's collective breaks on the closed socket."""
    from shiftlm.comm import shm

    shm.enable = lambda *_: os.kill(os.getpid(), signal.SIGKILL)
    start.worker_main(rank, *args)


def stuck_before_joining(rank, *args):
    """Rank 1 is alive but never joins (as if it hung importing): only the timeout can end the wait."""
    time.sleep(QUICK)


def offline_start(model_dir: str, stand_in: str, tp: int, sp: int, timeout: float, again: bool) -> None:
    """In the test's fresh process: `LLM(model_dir)` with the workers running `stand_in` and a
    STARTUP_TIMEOUT of `timeout` seconds, then (`again`) an `LLM` with real workers in the same
    process. Prints what happened, as JSON."""
    from shiftlm import LLM, SamplingParams

    real = start.worker_main, start.STARTUP_TIMEOUT
    start.worker_main, start.STARTUP_TIMEOUT = globals()[stand_in], datetime.timedelta(seconds=timeout)
    before = set(mp.active_children())
    began = time.monotonic()
    try:
        LLM(model_dir, tp=tp, sp=sp, device="cpu")
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    else:
        error = None
    seconds = time.monotonic() - began
    left = [proc.pid for proc in set(mp.active_children()) - before]
    start.worker_main, start.STARTUP_TIMEOUT = real
    tokens = None
    if again:
        with LLM(model_dir, sp=2, device="cpu") as llm:
            tokens = llm.generate("ab", SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids
    print(json.dumps(dict(error=error, seconds=seconds, left=left, tokens=tokens)))


def _offline(
    model_dir, stand_in: str, tp: int = 1, sp: int = 2, timeout: float | None = None, again: bool = False
) -> dict:
    timeout = timeout or start.STARTUP_TIMEOUT.total_seconds()
    call = f"offline_start({str(model_dir)!r}, {stand_in!r}, {tp}, {sp}, {timeout}, {again})"
    program = f"from tests.serve.test_startup_failures import offline_start; {call}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # two starts, the second a full one; a failure that waits out the rendezvous takes 300 s or more
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True, timeout=3 * QUICK
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"stderr": done.stderr}


def test_a_worker_dying_before_the_rendezvous_fails_the_llm_at_once(model_dir):
    """Rank 1 of four exits before joining: `LLM` raises in seconds naming it, ranks 2 and 3 (waiting
    in the rendezvous) are stopped too, and the next `LLM` of the process starts and generates."""
    out = _offline(model_dir, "unreachable_store", tp=2, sp=2, again=True)
    assert out["error"] is not None and out["error"].startswith("RankStartError: rank 1 (pid ")
    assert out["error"].endswith("died while the ranks were starting (exit code 1)")
    assert out["seconds"] < QUICK
    assert out["left"] == []
    assert "rank 1 failed to start: the rendezvous store refused the connection" in out["stderr"]
    assert len(out["tokens"]) == 2


@pytest.mark.parametrize(
    "stand_in, how",
    [("unreadable_weights", "exit code 1"), ("killed_in_a_collective", "killed by SIGKILL")],
    ids=["load-fails", "killed-in-collective"],
)
def test_a_worker_dying_while_loading_fails_the_llm_at_once(model_dir, stand_in, how):
    """After the group has formed: rank 0 waiting for rank 1 in a group the load makes (the store), or
    in a collective that rank 1's death broke (gloo's socket), names rank 1 within seconds."""
    out = _offline(model_dir, stand_in)
    assert out["error"] is not None and out["error"].startswith("RankStartError: rank 1 (pid ")
    assert out["error"].endswith(f"died while the ranks were starting ({how})")
    assert out["seconds"] < QUICK
    assert out["left"] == []


def test_a_worker_alive_but_stuck_fails_the_llm_at_the_startup_timeout(model_dir):
    """The timeout still bounds a worker that lives but never joins (3 s here), and stops it."""
    out = _offline(model_dir, "stuck_before_joining", timeout=3)
    assert out["error"] is not None and out["error"].startswith(
        "DistStoreError: the ranks did not meet within 0:00:03"
    )
    assert 3 < out["seconds"] < QUICK
    assert out["left"] == []


@pytest.mark.parametrize("sp", [1, 2])
def test_rank_0s_own_error_is_raised_as_it_is(model_dir, monkeypatch, sp):
    """A checkpoint error on rank 0 (every rank would meet it) stays the error, not a worker's exit;
    the worker is stopped, and with one rank there is no group to leave."""
    from shiftlm import LLM
    from shiftlm.errors import CheckpointError

    def truncated(_):
        raise CheckpointError("model.safetensors is truncated")

    monkeypatch.setattr(start, "load_runner", truncated)
    before = set(mp.active_children())
    with pytest.raises(CheckpointError, match="truncated"):
        LLM(str(model_dir), sp=sp, device="cpu")
    assert set(mp.active_children()) == before


def _spawned_worker(parent: int) -> int | None:
    """The pid of a rank that `parent` spawned (multiprocessing's spawn_main), or None yet."""
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text()
            command = (entry / "cmdline").read_bytes()
        except (OSError, NotADirectoryError):
            continue
        if f"\nPPid:\t{parent}\n" in status and b"spawn_main" in command:
            return int(entry.name)
    return None


def test_serve_exits_at_once_with_one_line_when_a_worker_is_killed_while_starting(model_dir):
    """`shiftlm serve --sp 2` as a user starts it, its worker killed (as by the OOM killer) as soon as
    it is spawned: the server exits non-zero within seconds with one line naming rank 1, no traceback."""
    command = [sys.executable, "-m", "shiftlm.cli", "serve", "--model", str(model_dir), "--sp", "2"]
    command += ["--device", "cpu", "--port", "0"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + QUICK
        while (worker := _spawned_worker(server.pid)) is None and time.monotonic() < deadline:
            assert server.poll() is None, server.stderr.read()
            time.sleep(0.01)
        assert worker is not None, "the server spawned no worker"
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = server.communicate(timeout=QUICK)
        seconds = time.monotonic() - killed
    finally:
        server.kill()
    assert server.returncode == 1
    assert seconds < QUICK
    assert stderr.strip().splitlines() == [
        f"shiftlm serve: error: failed to start: rank 1 (pid {worker}) died while the ranks were "
        "starting (killed by SIGKILL)"
    ]
