"""C4 drill: a rank hangs mid-run; the watchdog names it, torchrun restarts, training resumes losing nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from shiftlm.train.config import load_config
from shiftlm.train.trainer import train

BASE = [
    "--model.name=micro",
    "--parallel.dp=2",
    "--train.seq_len=32",
    "--train.global_batch=4",
    "--train.steps=6",
    "--optim.warmup_steps=2",
    "--checkpoint.every=2",
    "--log.progress=off",
]


def _uninterrupted(log_dir: str) -> dict[int, float]:
    return train(
        load_config(None, [*BASE, f"--log.dir={log_dir}", "--checkpoint.resume=false"]), quiet=True
    ).losses


def _torchrun(run_dir, env):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "shiftlm",
        "train",
        "--json",
        *BASE,
        f"--log.dir={run_dir}",
        "--monitor.watchdog_s=4",
    ]
    return subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env}, timeout=300)


def test_a_hung_rank_is_named_and_the_relaunched_job_resumes_losing_nothing(ranks, tmp_path):
    """What `torchrun --max-restarts N` automates, step by step: hang, diagnosis, exit 75, relaunch."""
    reference = ranks.run(2, _uninterrupted, str(tmp_path / "reference"))[0]
    run_dir = tmp_path / "drill"
    hung = _torchrun(run_dir, {"OMP_NUM_THREADS": "1", "SHIFTLM_FAULT": "hang:rank=1,step=3"})
    assert hung.returncode != 0
    assert "rank 1 never entered all_reduce" in hung.stderr and "exiting with code 75" in hung.stderr
    assert (run_dir / "ledgers" / "ledger-rank0.json").exists()  # for `shiftlm monitor report`
    # the relaunch resumes from the step-2 checkpoint and reproduces the rest exactly
    resumed = _torchrun(run_dir, {"OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    losses = {int(step): loss for step, loss in summary["losses"].items()}
    assert losses == {step: reference[step] for step in (3, 4, 5, 6)}
