"""`shiftlm train --elastic`: a rank named dead or persistently slow is excluded, the job goes on at a
smaller dp with the same global batch and data position (issue 13, item 5)."""

from __future__ import annotations

import json

import pytest

from tests.chaos.train_run import train


def _restarts(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]


def test_a_rank_that_dies_at_every_attempt_is_excluded_and_training_finishes(tmp_path):
    reference = train(tmp_path / "reference", "--train.steps=6", "--checkpoint.every=2")
    assert reference.returncode == 0, reference.stderr[-3000:]
    run_dir = tmp_path / "elastic"
    steps = ["--train.steps=6", "--checkpoint.every=2"]
    elastic = train(run_dir, *steps, "--elastic", fault="kill:rank=1,step=5")  # slot 1 dies every time
    assert elastic.returncode == 0, elastic.stderr[-3000:]
    assert "[shiftlm.elastic] excluded rank 1 (dp1 pp0 sp0 tp0): process killed by SIGKILL" in elastic.stderr
    assert "dp 2 -> 1, gradient accumulation 2 -> 4 (global batch 4 kept)" in elastic.stderr
    assert [(e["kind"], e["excluded"], e["dp"]) for e in _restarts(run_dir)] == [("died", [1], 1)]
    # resumed from the step-4 checkpoint: the same samples, the same global batch, another sum order
    losses, expected = elastic.losses(), reference.losses()
    assert sorted(losses) == [5, 6]
    assert losses == pytest.approx({s: expected[s] for s in (5, 6)}, rel=1e-5)


def test_the_same_dead_rank_without_elastic_fails_every_restart_with_exit_75(tmp_path):
    plain = train(
        tmp_path / "plain",
        "--train.steps=6",
        "--checkpoint.every=2",
        "--max-restarts=1",
        fault="kill:rank=1,step=5",
    )
    assert plain.returncode == 75, plain.stderr[-3000:]
    assert plain.stderr.count("failed: process killed by SIGKILL") == 2  # the first attempt and the restart


def test_a_persistently_slow_rank_is_excluded(tmp_path):
    run_dir = tmp_path / "slow"
    slow = train(
        run_dir, "--train.steps=12", "--monitor.straggler_every=3", "--elastic", fault="slow:rank=1,ms=150"
    )
    assert slow.returncode == 0, slow.stderr[-3000:]
    assert (
        "[shiftlm.elastic] excluded rank 1 (dp1 pp0 sp0 tp0): step 9: rank 1 (dp1 pp0 sp0 tp0) slowest"
        in (slow.stderr)
    )
    assert [(e["kind"], e["excluded"]) for e in _restarts(run_dir)] == [("straggler", [1])]
    assert sorted(slow.losses()) == [10, 11, 12]  # resumed from the checkpoint written at step 9
