"""Stragglers are named while `shiftlm train` runs, and `shiftlm monitor report RUN` works after any
run; a clean run on this loaded machine names no one (issue 13, item 4)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.chaos.train_run import train

WATCHED = ["--train.steps=12", "--monitor.straggler_every=3"]


def _report(run_dir) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "shiftlm", "monitor", "report", str(run_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _named(run_dir) -> list[list[int]]:
    lines = (run_dir / "ledgers" / "stragglers.jsonl").read_text().splitlines()
    return [json.loads(line)["named"] for line in lines]


def test_a_slow_rank_is_named_during_training_with_its_coordinates(tmp_path):
    run_dir = tmp_path / "slow"
    slow = train(run_dir, *WATCHED, fault="slow:rank=1,ms=150")
    assert slow.returncode == 0, slow.stderr[-3000:]
    assert "[shiftlm.monitor] step 9: rank 1 (dp1 pp0 sp0 tp0) slowest in" in slow.stderr
    assert [1] in _named(run_dir)
    assert _report(run_dir)["stragglers"]["culprits"] == [1]  # the run's ledgers, after a clean exit


def test_a_clean_run_under_load_names_no_straggler(tmp_path):
    run_dir = tmp_path / "clean"
    clean = train(run_dir, *WATCHED)
    assert clean.returncode == 0, clean.stderr[-3000:]
    assert "slowest in" not in clean.stderr
    named = _named(run_dir)
    assert len(named) == 4 and not any(named)  # checks at steps 3, 6, 9 and 12
    assert sorted(_report(run_dir)["ranks_with_ledger"]) == [0, 1]
