"""Training throughput per layout on 2 local CPU ranks: tokens/s, TFLOP/s per rank, MFU on this CPU.

    python bench/train.py --steps 8 --out bench/train.json

MFU needs a peak; a CPU has no catalog entry, so this script measures one: the best fp32 GEMM
FLOP/s of one thread (each rank runs one thread), 2 n^3 FLOPs per n x n matmul. The model FLOPs are
`shiftlm.train.metrics.flops_per_token` (PaLM Appendix B). The first 2 steps are warm-up and dropped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

LAYOUTS = {
    "1 rank": ([], 1),
    "dp2": (["--parallel.dp=2"], 2),
    "tp2": (["--parallel.tp=2"], 2),
    "sp2": (["--parallel.sp=2"], 2),
    "pp2 1f1b": (["--parallel.pp=2", "--train.schedule=1f1b"], 2),
    "pp2 zb_v": (["--parallel.pp=2", "--train.schedule=zb_v"], 2),
}


def cpu_peak_flops(size: int = 512, repeats: int = 5) -> float:
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(size, size), torch.randn(size, size)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def bench_layout(overrides: list[str], nproc: int, steps: int) -> dict:
    from shiftlm.launch import LocalWorkers
    from shiftlm.train.cli import run_training
    from shiftlm.train.config import load_config

    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config(
            None,
            [
                "--model.name=tiny",
                "--train.seq_len=128",
                "--train.micro_batch=4",
                "--train.global_batch=16",
                f"--train.steps={steps}",
                "--checkpoint.resume=false",
                f"--checkpoint.every={10 * steps}",
                f"--log.dir={run_dir}",
                *overrides,
            ],
        )
        with LocalWorkers(nproc) as workers:
            workers.run(run_training, config.to_dict(), True)
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()][2:]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
        "tflops_per_rank": statistics.median(r["tflops_per_device"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    peak = cpu_peak_flops()
    results = {
        "cpu_peak_tflops_per_thread": peak / 1e12,
        "model": "tiny",
        "seq_len": 128,
        "global_batch": 16,
        "layouts": {},
    }
    for name, (overrides, nproc) in LAYOUTS.items():
        row = bench_layout(overrides, nproc, args.steps)
        row["mfu_on_this_cpu"] = row["tflops_per_rank"] * 1e12 / peak
        results["layouts"][name] = row
    text = json.dumps(results, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
