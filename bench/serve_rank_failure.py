"""How fast `shiftlm serve` notices a dead or stopped worker rank (issue 13.2).

    python bench/serve_rank_failure.py [--repeats 2] [--out bench/results]

Starts `shiftlm serve --sp 2` on a tiny checkpoint (idle: no request in flight, the hardest case for
a server that only notices failures through collectives), sends kill -9 or SIGSTOP to rank 1, and
times /health turning 503 and the process exiting (code 75). Writes serve_rank_failure.json and .png.
The machine is shared: the times include scheduling delays of the moment.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import httpx

from shiftlm.serve.engine.tokenizer import write_char_tokenizer
from shiftlm.serve.local_server import local_server
from shiftlm.tools.tiny import make_tiny_checkpoint


def one_run(model_dir: Path, fault: str, rank_timeout: float) -> dict:
    args = [str(model_dir), "--sp", "2", "--log-interval", "0", "--rank-timeout", str(rank_timeout)]
    with local_server(args, timeout=400) as server:
        (worker,) = server.worker_pids()
        start = time.monotonic()
        os.kill(worker, signal.SIGKILL if fault == "kill -9" else signal.SIGSTOP)
        unhealthy = None
        while server.process.poll() is None and time.monotonic() - start < 120:
            try:
                if unhealthy is None and httpx.get(f"{server.url}/health", timeout=1).status_code == 503:
                    unhealthy = time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        code = server.process.wait(timeout=60)
        return {
            "fault": fault,
            "rank_timeout_s": rank_timeout,
            "health_503_after_s": None if unhealthy is None else round(unhealthy, 3),
            "exit_after_s": round(time.monotonic() - start, 3),
            "exit_code": code,
        }


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    labels = [f"{r['fault']} #{i}" for i, r in enumerate(runs)]
    ax.barh(labels, [r["exit_after_s"] for r in runs], color="#bbb", label="process exited (75)")
    ax.barh(labels, [r["health_503_after_s"] or 0 for r in runs], color="#c33", label="/health 503")
    ax.set_xlabel("seconds after the fault (idle server, --sp 2)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rank-timeout", type=float, default=10.0, help="the server's default")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint(Path(tmp) / "tiny", "llama-gqa")
        write_char_tokenizer(model_dir, vocab_size=250)
        runs = [
            one_run(model_dir, fault, args.rank_timeout)
            for fault in ("kill -9", "SIGSTOP")
            for _ in range(args.repeats)
        ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_rank_failure.json").write_text(json.dumps({"runs": runs}, indent=1))
    plot(runs, out / "serve_rank_failure.png")
    print(json.dumps({"runs": runs}))


if __name__ == "__main__":
    main()
