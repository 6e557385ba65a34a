"""Run `shiftlm train` the way a user does (a real CLI process and its ranks), with a deadline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

TINY = [
    "--nproc=2",
    "--model.name=micro",
    "--parallel.dp=2",
    "--train.seq_len=32",
    "--train.global_batch=4",
    "--optim.warmup_steps=2",
    "--log.progress=off",
]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    wall_s: float

    def losses(self) -> dict[int, float]:
        summary = json.loads(self.stdout.strip().splitlines()[-1])
        return {int(step): loss for step, loss in summary["losses"].items()}


def train(run_dir: Path, *args: str, fault: str | None = None, timeout: float = 280) -> Run:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("SHIFTLM_FAULT", None)
    if fault:
        env["SHIFTLM_FAULT"] = fault
    command = [sys.executable, "-m", "shiftlm", "train", "--json", *TINY, f"--log.dir={run_dir}", *args]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    return Run(done.returncode, done.stdout, done.stderr, time.monotonic() - start)
