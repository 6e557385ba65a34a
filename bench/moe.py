"""MoE token dispatch: all-to-all vs all-gather + local selection, on this machine's local ranks.

    python bench/moe.py                         # 2 gloo ranks, ep = 2, a Mixtral-shaped layer (small)
    python bench/moe.py --ranks 4 --tokens 1024 --steps 5 --json

Every rank holds `--tokens` tokens and 1/ranks of the experts of one `SparseMoE` layer (hidden 512,
8 experts, top-2, expert width 1024; seeded weights, the same on every rank), and runs forward +
backward with each dispatcher, interleaved step by step so that the shared cores' noise hits both:
`all_to_all` sends each (token, choice) row to its expert's rank and back (comm.all_to_all_rows);
`all_gather` gathers every rank's tokens and routing, computes this rank's experts' rows, and
reduce-scatters the outputs (Megatron's AllGather dispatcher). Reported per dispatcher: tokens/s (all
ranks' tokens over the best step's time, first rank's start to last rank's end) and the bytes one
rank hands to collectives per step on the ep group (comm.counters; gloo's reduce-scatter is an
all-reduce, counted as its logical input). The two must compute the same outputs (checked). Writes
bench/results/moe.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
DISPATCHERS = ("all_to_all", "all_gather")
_STATE: dict = {}


def setup(ranks: int, tokens: int, hidden: int, experts: int, width: int, top_k: int) -> None:
    import torch

    from shiftlm.config import ModelConfig
    from shiftlm.mesh import Mesh
    from shiftlm.model.moe import SparseMoE
    from shiftlm.parallel import ParallelConfig

    torch.set_num_threads(1)
    config = ModelConfig(
        model_type="mixtral",
        hidden_size=hidden,
        num_heads=8,
        num_kv_heads=8,
        head_dim=hidden // 8,
        intermediate_size=width,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
    )
    mesh = Mesh(ParallelConfig(dp=ranks, ep=ranks))
    layer = SparseMoE(config, mesh.tp, mesh.ep)
    with torch.no_grad():
        for name, param in layer.named_parameters():  # each full tensor seeded by its name
            generator = torch.Generator().manual_seed(sum(map(ord, name)))
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    generator = torch.Generator().manual_seed(1000 + mesh.rank)
    x = torch.randn(tokens, hidden, generator=generator)
    _STATE.update(mesh=mesh, layer=layer, x=x)
    for dispatch in DISPATCHERS:  # warm-up, and the two must agree
        _STATE[f"out_{dispatch}"] = step(dispatch)[2]
    a, b = _STATE["out_all_to_all"], _STATE["out_all_gather"]
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()


def step(dispatch: str) -> tuple[float, int, object]:
    """One forward + backward; (seconds first start to last end, bytes on the ep group, output)."""
    import torch.distributed as dist

    from shiftlm.comm import counters

    s = _STATE
    s["layer"].dispatch = dispatch
    s["layer"].zero_grad(set_to_none=True)
    x = s["x"].clone().requires_grad_(True)
    dist.barrier()
    counters.reset()
    start = time.perf_counter()
    out = s["layer"].partial(x)
    out.square().mean().backward()
    moved = sum(b for (op, group), b in counters.bytes.items() if group == "ep")
    dist.barrier()
    return time.perf_counter() - start, moved, out.detach()


def measure(steps: int, *shape: int) -> dict[str, list[tuple[float, int]]]:
    """On every rank, in one task (the worker pool frees a task's process groups when it ends): set
    up, then `steps` interleaved (seconds, bytes) per dispatcher."""
    setup(*shape)
    out: dict[str, list[tuple[float, int]]] = {d: [] for d in DISPATCHERS}
    for _ in range(steps):
        for dispatch in DISPATCHERS:
            out[dispatch].append(step(dispatch)[:2])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2, help="local gloo ranks = ep")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024, help="one expert's FFN width")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args()

    from shiftlm.launch import LocalWorkers

    shape = (args.ranks, args.tokens, args.hidden, args.experts, args.width, args.top_k)
    with LocalWorkers(args.ranks) as workers:
        per_rank = workers.run(measure, args.steps, *shape)
    # a step's time is its slowest rank's (the barriers make them nearly equal); bytes: the busiest rank
    best = {d: min(max(r[d][i][0] for r in per_rank) for i in range(args.steps)) for d in DISPATCHERS}
    moved = {d: max(r[d][-1][1] for r in per_rank) for d in DISPATCHERS}
    total_tokens = args.ranks * args.tokens
    rows = {
        d: {
            "tokens_per_s": round(total_tokens / best[d], 1),
            "best_step_s": round(best[d], 4),
            "bytes_per_step_per_rank": moved[d],
        }
        for d in DISPATCHERS
    }
    result = {"config": vars(args), "dispatchers": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "moe.json").write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.ranks} ranks x {args.tokens} tokens, {args.experts} experts top-{args.top_k}")
    for d, row in rows.items():
        print(
            f"{d:>10}: {row['tokens_per_s']:>10.1f} tokens/s  best step {row['best_step_s']:.4f} s  "
            f"{row['bytes_per_step_per_rank'] / 1e6:.2f} MB per rank per step"
        )


if __name__ == "__main__":
    main()
