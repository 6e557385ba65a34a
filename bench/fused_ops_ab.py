"""The CPU kernels' fused RMSNorm and SwiGLU (kernels/csrc/cpu_kernels.cpp) vs PyTorch's ops, in one process.

    python bench/fused_ops_ab.py                 # 32 rows (a decode step's width) and 4 x 128 rows
    python bench/fused_ops_ab.py --rounds 30 --json

The model is bench/vs_vllm.py's random-weight Llama (hidden 512, 4 layers, 8/2 heads, fp32), one thread,
no grad, weights packed for oneDNN both ways (`PackedWeights(None)`: PyTorch's `rms_norm`, `silu` and
product; `PackedWeights(kernel)`: the fused passes). The two run alternately on the same input every
round; the result is the minimum wall time over rounds of the whole forward (LM head on every row).
Writes bench/results/fused_ops_ab.json with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CASES = {"32 rows": (1, 32), "4 x 128 rows": (4, 128)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fused_ops_ab.json")
    args = parser.parse_args()

    from shiftlm.config import ModelConfig
    from shiftlm.kernels import cpu as cpu_kernels
    from shiftlm.model import build_model
    from shiftlm.model.inference_linear import PackedWeights
    from shiftlm.model.ops import InferenceOps

    torch.set_num_threads(1)
    kernel = cpu_kernels.load()
    if kernel is None:
        print("error: the CPU kernels could not be built here (no C++ compiler?); nothing to compare")
        return 2
    config = ModelConfig(
        vocab_size=8000,
        hidden_size=512,
        intermediate_size=1408,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
    )
    model = build_model(config, seed=0).eval()
    load_before = os.getloadavg()[0]
    result = {"rounds": args.rounds, "cases": {}}
    for name, shape in CASES.items():
        ids = torch.randint(0, config.vocab_size, shape)
        ways = {
            "pytorch_ops": InferenceOps(PackedWeights(None)),
            "fused": InferenceOps(PackedWeights(kernel)),
        }
        times: dict[str, list[float]] = {way: [] for way in ways}
        with torch.no_grad():
            for round_ in range(args.rounds):
                order = list(ways) if round_ % 2 == 0 else list(reversed(ways))
                for way in order:
                    start = time.perf_counter()
                    model(ids, ops=ways[way])
                    times[way].append(time.perf_counter() - start)
        best = {way: 1e3 * min(values) for way, values in times.items()}
        result["cases"][name] = {f"{way}_ms": round(ms, 3) for way, ms in best.items()}
        result["cases"][name]["fused_over_pytorch"] = round(best["fused"] / best["pytorch_ops"], 3)
        if not args.json:
            print(
                f"{name:>14}: pytorch ops {best['pytorch_ops']:.2f} ms, fused {best['fused']:.2f} ms "
                f"({best['fused'] / best['pytorch_ops']:.3f}x)"
            )
    result["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1) if args.json else f"wrote {args.out} (load {result['load_average']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
