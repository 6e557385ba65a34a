"""Ctrl-C and SIGTERM through the real `shiftlm train`: a checkpoint at the next step boundary, a line
naming it and the exact command that resumes, exit 130 / 143; and the time-based checkpoint interval."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shiftlm.cli import main
from shiftlm.train.checkpoint import latest_checkpoint, read_trainer_state

TINY = ["--model.name=micro", "--train.seq_len=32", "--train.global_batch=4", "--log.progress=off"]


def _start(run_dir: Path, *args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "shiftlm", "train", *TINY, "--train.steps=100000", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [*command, f"--log.dir={run_dir}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def _interrupt_after_two_steps(proc: subprocess.Popen, signum: int) -> str:
    lines = []
    deadline = time.monotonic() + 240
    for line in proc.stdout:  # the step lines arrive as the run goes
        lines.append(line)
        if line.startswith("step ") and line.split()[1].startswith("2/"):
            proc.send_signal(signum)
            break
        assert time.monotonic() < deadline, "".join(lines)
    rest, _ = proc.communicate(timeout=120)
    return "".join(lines) + rest


@pytest.mark.parametrize(
    ("signum", "code", "nproc"),
    [(signal.SIGINT, 130, []), (signal.SIGTERM, 143, ["--nproc=2", "--parallel.dp=2"])],
)
def test_a_signal_saves_a_checkpoint_names_it_and_the_resume_command(tmp_path, signum, code, nproc):
    run_dir = tmp_path / "run"
    proc = _start(run_dir, *nproc, "--overwrite")  # a resume command must not repeat --overwrite
    output = _interrupt_after_two_steps(proc, signum)
    assert proc.returncode == code, output
    assert "Traceback" not in output
    latest = latest_checkpoint(run_dir / "checkpoints")
    assert latest is not None, output
    step = read_trainer_state(latest)["step"]
    assert step >= 2
    last = output.strip().splitlines()[-1]
    name = signal.Signals(signum).name
    assert last.startswith(f"[shiftlm] {name}: saved {latest} (step {step}); to resume: shiftlm train "), last
    command = shlex.split(last.split("to resume: ", 1)[1])
    assert "--overwrite" not in command
    # the printed command, with a near goal, continues from that checkpoint
    command = [c for c in command[1:] if not c.startswith("--train.steps=")] + [f"--train.steps={step + 1}"]
    resumed = subprocess.run(
        [sys.executable, "-m", "shiftlm", *command], capture_output=True, text=True, timeout=240
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from step {step}" in resumed.stdout
    assert read_trainer_state(latest_checkpoint(run_dir / "checkpoints"))["step"] == step + 1


def test_a_checkpoint_is_written_every_every_s_seconds(capsys, tmp_path):
    def run(every_s: str, log_dir: Path) -> list[str]:
        code = main(
            ["train", *TINY, "--train.steps=3", f"--checkpoint.every_s={every_s}", f"--log.dir={log_dir}"]
        )
        assert code == 0, capsys.readouterr().err
        return sorted(p.name for p in (log_dir / "checkpoints").iterdir())

    assert run("0", tmp_path / "off") == ["step_00000003"]  # only the last step
    assert run("1e-9", tmp_path / "on") == ["step_00000002", "step_00000003"]  # every step (keep = 2)


_STUCK_RANK = """
import sys, time, datetime, torch, torch.distributed as dist
from shiftlm.train.stopping import StepBoundary
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=90))
dist.barrier()
if rank == 1:
    time.sleep(120)  # never enters the step's collective
with StepBoundary(0.0, torch.device("cpu"), stuck_s=2.0):
    print("in the step", flush=True)
    dist.all_reduce(torch.ones(1))  # blocks in gloo's C++ wait: no Python handler runs here
"""


def test_a_signalled_rank_blocked_in_a_collective_exits_after_the_watchdogs_limit(tmp_path):
    """torchrun tears a failed job down with SIGTERM and kills only after 30 s: a rank blocked in a
    collective whose peer hangs never reaches the step boundary, so it leaves `stuck_s` after the
    signal, with 143 and a line saying why, not when gloo's 90 s timeout or the launcher's kill ends it."""
    from shiftlm.launch import free_port

    script = tmp_path / "stuck.py"
    script.write_text(_STUCK_RANK)
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in (0, 1)
    ]
    try:
        assert procs[0].stdout.readline().strip() == "in the step"
        time.sleep(0.5)  # inside all_reduce
        signalled = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        code = procs[0].wait(timeout=60)
        waited = time.monotonic() - signalled
        stderr = procs[0].stderr.read()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert code == 143, stderr
    assert 2.0 <= waited < 15, waited
    assert "SIGTERM: no step boundary 2 s (monitor.watchdog_s) after the signal" in stderr
