"""The cost of `train.deterministic` per training step (docs/moe.md, "Bit-exact across ep").

    python bench/moe_deterministic.py                 # dp4 ep2, 8 steps each way, 3 rounds
    python bench/moe_deterministic.py --ep 4 --rounds 1

A qwen2_moe shaped like the tests' micro model but wider (hidden 128, 8 experts top-2 of width 256,
a shared expert of 256, 4 layers, layer 0 dense), seq 128, global batch 8, micro-batch 1 (2 per
rank: the deterministic step's per-source blocks, tree sums and norm, with accumulation), fp32 on
4 local gloo ranks. Each round runs the default step and the deterministic one in turn on the same
ranks; a step's time is the median over steps 3..N, the reported one the median over rounds.
Writes bench/results/moe_deterministic_epE.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def model_dir() -> str:
    from shiftlm.config import ModelConfig
    from shiftlm.train.setup import EMBEDDED_MODELS

    shape = {
        **EMBEDDED_MODELS["micro-moe"],
        "hidden_size": 128,
        "intermediate_size": 256,
        "head_dim": 32,
        "num_experts": 8,
        "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 256,
    }
    directory = tempfile.mkdtemp(prefix="moe-deterministic-")
    (Path(directory) / "config.json").write_text(
        json.dumps(ModelConfig(vocab_size=2048, **shape).to_hf_dict())
    )
    return directory


def step_times(args: list[str], steps: int) -> list[float]:
    """Seconds of each optimizer step on this rank (every rank of the pool calls it)."""
    import torch.distributed as dist

    from shiftlm.train.config import load_config
    from shiftlm.train.trainer import Trainer

    trainer = Trainer(load_config(None, args), quiet=True)
    times = []
    for step in range(steps):
        batches = trainer.reader.step(step)
        dist.barrier()
        tick = time.perf_counter()
        trainer.step(step, batches)
        times.append(time.perf_counter() - tick)
    dist.barrier()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    from shiftlm.launch import LocalWorkers

    base = [
        f"--model.name={model_dir()}",
        "--parallel.dp=4",
        f"--parallel.ep={options.ep}",
        "--train.seq_len=128",
        "--train.global_batch=8",
        "--train.micro_batch=1",
        "--checkpoint.resume=false",
        "--log.progress=off",
    ]
    medians: dict[str, list[float]] = {"default": [], "deterministic": []}
    workers = LocalWorkers(4)
    try:
        for _ in range(options.rounds):
            for name, flag in (("default", "false"), ("deterministic", "true")):
                args = [*base, f"--log.dir={tempfile.mkdtemp()}", f"--train.deterministic={flag}"]
                times = workers.run(step_times, args, options.steps)
                medians[name].append(max(statistics.median(t[2:]) for t in times))  # the slowest rank
    finally:
        workers.close()
    report = {name: statistics.median(values) * 1e3 for name, values in medians.items()}
    report["ratio"] = report["deterministic"] / report["default"]
    report["rounds_ms"] = {name: [v * 1e3 for v in values] for name, values in medians.items()}
    print(
        f"dp4 ep{options.ep}: default {report['default']:.1f} ms/step, deterministic "
        f"{report['deterministic']:.1f} ms/step ({report['ratio']:.2f}x)",
        flush=True,
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"moe_deterministic_ep{options.ep}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
