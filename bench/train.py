"""Training throughput per layout on 2 local CPU ranks: tokens/s, TFLOP/s per rank, MFU on this CPU;
and the peak memory of activation recomputation (none / selective / full) on a bigger model.

    python bench/train.py --steps 8 --out bench/train.json

MFU needs a peak; a CPU has no catalog entry, so this script measures one: the best fp32 GEMM
FLOP/s of one thread (each rank runs one thread), 2 n^3 FLOPs per n x n matmul. The model FLOPs are
`ModelConfig.flops_per_token` (PaLM Appendix B). The first 2 steps are warm-up and dropped.
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
    "pp2 bitpipe": (["--parallel.pp=2", "--train.schedule=bitpipe"], 2),
}
# recomputation: one rank, a model whose activations dominate its memory (8 layers x 256 wide, seq 1024)
RECOMPUTE_MODEL = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=704,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    head_dim=32,
    max_position_embeddings=4096,
)
RECOMPUTE_RUN = ["--train.seq_len=1024", "--train.micro_batch=4", "--train.global_batch=4"]


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


def bench_layout(overrides: list[str], nproc: int, steps: int, warmup: int = 2) -> dict:
    from shiftlm.launch import LocalWorkers
    from shiftlm.train.config import load_config
    from shiftlm.train.elastic import run_training

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
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    timed = rows[warmup:]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "tflops_per_rank": statistics.median(r["tflops_per_device"] for r in timed),
        "peak_rss_gb": max(r["memory_gb"] for r in rows),  # of the worker process (ru_maxrss)
    }


def bench_recompute(steps: int) -> dict:
    """Peak resident memory and speed of one fresh rank per recompute mode (same model and batch)."""
    from shiftlm.config import ModelConfig

    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(ModelConfig(**RECOMPUTE_MODEL).to_hf_dict()))
        return {
            mode: bench_layout(
                [f"--model.name={model_dir}", *RECOMPUTE_RUN, f"--train.recompute={mode}"], 1, steps, warmup=1
            )
            for mode in ("none", "selective", "full")
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--recompute-steps", type=int, default=3, help="steps per recompute mode")
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
    results["recompute"] = {
        "model": RECOMPUTE_MODEL,
        "run": RECOMPUTE_RUN,
        **bench_recompute(args.recompute_steps),
    }
    text = json.dumps(results, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
