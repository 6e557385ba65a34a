"""A mixture-of-experts decode step served with the experts read in place (`SparseMoE.stack_experts`)
against stacking a copy of every expert each step (what serving did before; training's way), in one
process on the same weights, timed alternately.

    python bench/moe_serve_step.py [--rounds 3] [--json]

The model: a random Qwen2-MoE (hidden 512, 4 layers, 16 experts of width 512, top-2, a shared expert
of width 1024, vocab 8000) in fp32 on one thread; a decode step of 1 and of 16 sequences at context
160; per round the minimum thread CPU time of 20 steps, then the minimum over rounds. Writes
bench/results/moe_serve_step.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "moe_serve_step.json"))
    args = parser.parse_args()

    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from shiftlm.mesh import Mesh
    from shiftlm.model.moe import SparseMoE
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan
    from shiftlm.serve.worker.runner import ModelRunner

    torch.set_num_threads(1)
    config = Qwen2MoeConfig(
        vocab_size=8000,
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=1024,
        num_experts=16,
        num_experts_per_tok=2,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        Qwen2MoeForCausalLM(config).save_pretrained(path)
        runners = {
            way: ModelRunner.load(path, Mesh(ParallelConfig()), num_blocks=1024, block_size=16, gemv_rows=0)
            for way in ("in_place", "stack_per_step")
        }
    for layer in runners["stack_per_step"].shift_model.model.modules():
        if isinstance(layer, SparseMoE):
            layer._stacked = None  # stacked_weights() stacks anew, as before stack_experts
    result = {"rounds": args.rounds, "cases": {}}
    load_before = os.getloadavg()[0]
    for seqs in (1, 16):
        context, blocks = 160, 160 // 16 + 1
        prefill = [
            StepPlan(
                0,
                Mode.TP,
                (
                    ScheduledChunk(
                        i, (5,) * context, 0, tuple(range(i * blocks, (i + 1) * blocks)), True, row=i
                    ),
                ),
            )
            for i in range(seqs)
        ]
        decode = StepPlan(
            1, Mode.TP, tuple(ScheduledChunk(i, (7,), context, (), True, row=i) for i in range(seqs))
        )
        best = {way: float("inf") for way in runners}
        for round_ in range(args.rounds):
            for way in runners if round_ % 2 == 0 else reversed(list(runners)):
                runner = runners[way]
                for plan in prefill:
                    runner.execute(plan)
                for _ in range(20):
                    start = time.thread_time()
                    runner.execute(decode)
                    best[way] = min(best[way], time.thread_time() - start)
        case = {f"{way}_ms": round(1e3 * value, 3) for way, value in best.items()}
        case["in_place_over_stack_per_step"] = round(best["in_place"] / best["stack_per_step"], 3)
        result["cases"][f"{seqs} sequences @ {context}"] = case
        if not args.json:
            print(f"{seqs:>2} sequences: in place {case['in_place_ms']:.2f} ms, stacked per step "
                  f"{case['stack_per_step_ms']:.2f} ms ({case['in_place_over_stack_per_step']:.3f}x)")  # fmt: skip
    result["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
