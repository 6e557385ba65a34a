"""Training failures under `shiftlm train --nproc`: the failed rank is named with its coordinates and
its own traceback, the other ranks stop within seconds, the exit code says whether to restart (75) or
fix (1), and the rerun resumes from the checkpoint bit for bit (issue 13, item 3)."""

from __future__ import annotations

import re

from tests.chaos.train_run import train


def _stopped_within(stderr: str) -> float:
    match = re.search(r"stopped every rank ([0-9.]+) s after the first failure", stderr)
    assert match, stderr[-3000:]
    return float(match.group(1))


def test_a_rank_killed_mid_step_is_named_exits_75_and_the_rerun_resumes_bit_exact(tmp_path):
    reference = train(tmp_path / "reference", "--train.steps=6", "--checkpoint.every=2")
    assert reference.returncode == 0, reference.stderr[-3000:]

    run_dir = tmp_path / "killed"
    killed = train(run_dir, "--train.steps=6", "--checkpoint.every=2", fault="kill:rank=1,step=5")
    assert killed.returncode == 75, killed.stderr[-3000:]
    assert "rank 1 (dp1 pp0 sp0 tp0) failed: process killed by SIGKILL" in killed.stderr
    assert "EOFError" not in killed.stderr
    assert _stopped_within(killed.stderr) < 10
    assert f"it continues from {run_dir / 'checkpoints'}" in killed.stderr and "(step 4)" in killed.stderr

    resumed = train(run_dir, "--train.steps=6", "--checkpoint.every=2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.losses() == {step: reference.losses()[step] for step in (5, 6)}


def test_an_exception_on_one_rank_prints_its_traceback_within_seconds(tmp_path):
    """The watchdog (300 s by default) is not what stops the job: the launcher sees the rank fail."""
    failed = train(
        tmp_path / "run", "--train.steps=6", "--checkpoint.every=2", fault="raise:rank=1,step=3", timeout=240
    )
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "rank 1 (dp1 pp0 sp0 tp0) failed: InjectedFault: injected fault on rank 1" in failed.stderr
    assert "traceback of rank 1:" in failed.stderr and 'faults.py", line' in failed.stderr
    assert "no heartbeat" not in failed.stderr
    assert _stopped_within(failed.stderr) < 10
    assert "to resume (after fixing the error above)" in failed.stderr


def test_a_hung_rank_is_named_and_the_launcher_exits_75(tmp_path):
    """The watchdog's message promises exit code 75; the local launcher now keeps that promise."""
    hung = train(tmp_path / "run", "--train.steps=6", "--monitor.watchdog_s=15", fault="hang:rank=1,step=3")
    assert hung.returncode == 75, hung.stderr[-3000:]
    assert "hang: rank 1 (dp1 pp0 sp0 tp0) stopped communicating" in hung.stderr
    assert _stopped_within(hung.stderr) < 10
