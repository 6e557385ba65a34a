"""MoE training layouts against one rank, beyond the test suite's three (docs/moe.md, "Training").

    python bench/moe_train_layouts.py                      # every layout below, 5 steps each
    python bench/moe_train_layouts.py --only cp2 --steps 3

The qwen2_moe micro model of tests/train (4 layers, layer 0 dense, 4 experts top-2, gated shared
expert, load-balancing loss coefficient 0.1; seeded init), seq 32, global batch 4, micro-batch 1,
fp32 on local gloo ranks. Prints each layout's largest relative loss difference from one rank and
writes bench/results/moe_train_layouts.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
LAYOUTS = {  # name: (ranks, overrides)
    "dp2_ep2": (2, ["--parallel.dp=2", "--parallel.ep=2"]),
    "tp2_megatron_sp": (2, ["--parallel.tp=2", "--parallel.sequence_parallel=true"]),
    "pp2_1f1b": (2, ["--parallel.pp=2", "--train.schedule=1f1b"]),
    "dp4_ep2_zero1": (4, ["--parallel.dp=4", "--parallel.ep=2", "--train.zero=1"]),
    "dp2_pp2_ep2_zb_v_zero2": (
        4,
        ["--parallel.dp=2", "--parallel.pp=2", "--parallel.ep=2", "--train.schedule=zb_v", "--train.zero=2"],
    ),
    "dp2_pp2_ep2_bitpipe": (
        4,
        ["--parallel.dp=2", "--parallel.pp=2", "--parallel.ep=2", "--train.schedule=bitpipe"],
    ),
    "cp2_dp2_ep2": (4, ["--parallel.dp=2", "--parallel.cp=2", "--parallel.ep=2"]),
    "sp2_dp2_ep4": (4, ["--parallel.sp=2", "--parallel.dp=2", "--parallel.ep=4"]),
    "dp2_ep2_recompute_full_zero3": (
        2,
        ["--parallel.dp=2", "--parallel.ep=2", "--train.recompute=full", "--train.zero=3"],
    ),
}


def model_dir() -> str:
    from shiftlm.config import ModelConfig
    from shiftlm.train.setup import EMBEDDED_MODELS

    config = ModelConfig(vocab_size=2048, **EMBEDDED_MODELS["micro-moe"])  # the tests' model
    directory = tempfile.mkdtemp(prefix="moe-train-")
    (Path(directory) / "config.json").write_text(json.dumps(config.to_hf_dict()))
    return directory


def losses(args: list[str]) -> dict[int, float]:
    """One run on this rank (every rank of a `LocalWorkers` pool calls it)."""
    import torch.distributed as dist

    from shiftlm.train.config import load_config
    from shiftlm.train.trainer import train

    result = train(load_config(None, args), quiet=True)
    if dist.is_initialized():
        dist.barrier()
    return result.losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--only", nargs="*", choices=list(LAYOUTS), help="these layouts only")
    options = parser.parse_args()
    from shiftlm.launch import LocalWorkers

    base = [
        f"--model.name={model_dir()}",
        "--train.seq_len=32",
        "--train.global_batch=4",
        "--train.micro_batch=1",
        f"--train.steps={options.steps}",
        "--optim.warmup_steps=2",
        "--checkpoint.resume=false",
        "--checkpoint.every=0",
        "--log.progress=off",
    ]

    def run(ranks: int, overrides: list[str]) -> dict[int, float]:
        workers = LocalWorkers(ranks)
        try:
            return workers.run(losses, [*base, f"--log.dir={tempfile.mkdtemp()}", *overrides])[0]
        finally:
            workers.close()

    one = run(1, [])
    report = {"one_rank": one, "layouts": {}}
    for name in options.only or LAYOUTS:
        ranks, overrides = LAYOUTS[name]
        got = run(ranks, overrides)
        worst = max(abs(got[s] - one[s]) / abs(one[s]) for s in one)
        report["layouts"][name] = {"ranks": ranks, "losses": got, "max_rel_diff": worst}
        print(f"{name:32s} {ranks} ranks  max relative loss difference {worst:.1e}", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "moe_train_layouts.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
