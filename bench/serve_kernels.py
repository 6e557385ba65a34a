"""The serving pieces of issue 11's 2026-11-26 work, each against what it replaced, on this machine:

    python bench/serve_kernels.py [--checkpoint-dir DIR] [--json]

1. shared-memory collectives (comm/shm.py) vs gloo: a 512-float all-reduce back to back on 2 ranks,
   and an in-process tp2 decode step (1 and 32 sequences at context 160; ranks pinned to cores 0 and
   1, rank 0 driving `runner.execute`, p50 wall of 60 steps), each variant in fresh processes;
2. the small-rows linears: a 1- and 2-sequence tp1 decode step with MKL's GEMV (`gemv_rows=2`) and
   with oneDNN's packed GEMM (`gemv_rows=0`), and what the startup probe chooses here;
3. RoPE of the fused Q|K view: the CPU kernel vs eager `apply_rope_qk` (512 and 32 tokens);
4. prefill attention per layer: the CPU kernel's tiles vs SDPA (causal from 0: `is_causal`; after
   cached context: gathered blocks with a mask);
5. the two 2-rank layouts' steps (2026-11-26, `--shift-threshold auto`): tp2 and the tp1·sp2 shift
   runner in full TP, and the shift runner in SP x TP, on a 32-sequence decode step and on 32 decode
   rows plus a 128-token prefill chunk (`shift_probe.probe_plan`), p50 of 40 interleaved;
6. one thread's fp32 GEMM rate: MKL's best 512^3 (bench/train.py's `cpu_peak_flops`) and oneDNN's
   packed GEMM on the model's shapes at 32 and 160 rows, hot and with a whole step's weights streamed;
7. the decode attention kernel of one layer (32 sequences x 160 keys), cache hot and cold.
The model is bench/vs_vllm.py's (hidden 512, 4 layers, 8/2 heads, fp32); one thread; times are
minimum (or median where said) over repeats. Writes bench/results/serve_kernels.json; `--stages`
runs some of them and updates only their entries there (each entry says when it was measured).
"""

# ruff: noqa: B023 -- every timed closure runs at once, inside its own loop iteration
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def _best(fn, reps: int = 30, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _decode_plan(seqs: int, context: int = 160):
    from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan

    blocks = (context + 1) // 16 + 1
    chunks = tuple(
        ScheduledChunk(i, (5,), context, tuple(range(i * blocks, (i + 1) * blocks)), True, row=i)
        for i in range(seqs)
    )
    return StepPlan(0, Mode.TP, chunks)


def _allreduce_us() -> dict:
    import torch.distributed as dist

    from shiftlm.comm import shm
    from shiftlm.comm.group import CommGroup
    from shiftlm.kernels import cpu as cpu_kernels

    rank, world = dist.get_rank(), dist.get_world_size()
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    group = CommGroup("tp", tuple(range(world)), dist.group.WORLD, rank)
    local = shm.enable(group, cpu_kernels.load())
    t = torch.randn(512)
    out = {"gloo_us": 1e6 * _best(lambda: dist.all_reduce(t), reps=500, warm=20)}
    if local is not None:
        out["shm_us"] = 1e6 * _best(lambda: local.all_reduce_(t), reps=500, warm=20)
    return out


def _tp2_steps(model_dir: str, shm_on: bool) -> dict | None:
    import torch.distributed as dist

    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    rank = dist.get_rank()
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    runner = ModelRunner.load(
        Path(model_dir),
        Mesh(ParallelConfig(tp=2)),
        num_blocks=64 * 12 + 16,
        block_size=16,
        shm_collectives=shm_on,
    )
    if rank != 0:
        runner.serve_steps()
        return None
    out = {}
    for seqs in (1, 32):
        plan = _decode_plan(seqs)
        for _ in range(5):
            runner.execute(plan)
        walls = []
        for _ in range(60):
            start = time.perf_counter()
            runner.execute(plan)
            walls.append(time.perf_counter() - start)
        out[f"{seqs} seqs p50 ms"] = 1e3 * sorted(walls)[len(walls) // 2]
    runner.stop_workers()
    return out


def _tp1_steps(model_dir: Path) -> dict:
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    out = {}
    for gemv_rows in (2, 0, None):
        runner = ModelRunner.load(
            model_dir, Mesh(ParallelConfig()), num_blocks=64 * 12 + 16, block_size=16, gemv_rows=gemv_rows
        )
        if gemv_rows is None:
            out["probe chooses gemv_rows"] = runner.shift_model.packed.gemv_rows
            continue
        for seqs in (1, 2, 32):
            plan = _decode_plan(seqs)
            out[f"gemv_rows={gemv_rows} {seqs} seqs ms"] = 1e3 * _best(lambda: runner.execute(plan))
    return out


def _two_rank_steps(model_dir: str, tp: int, sp: int) -> dict | None:
    import random

    import torch.distributed as dist

    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.plan import Mode
    from shiftlm.serve.worker.runner import ModelRunner
    from shiftlm.serve.worker.shift_probe import probe_plan

    rank = dist.get_rank()
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    runner = ModelRunner.load(
        Path(model_dir), Mesh(ParallelConfig(tp=tp, sp=sp)), num_blocks=64 * 12 + 64, block_size=16
    )
    if rank != 0:
        runner.serve_steps()
        return None
    modes = (Mode.TP, Mode.SP_TP) if sp > 1 else (Mode.TP,)
    plans = {}
    for mode in modes:
        plans[f"32 decode, {mode.value}"] = dataclasses.replace(_decode_plan(32), mode=mode)
        plans[f"32 decode + 128 prefill, {mode.value}"] = probe_plan(160, mode, 16, 64 * 12 + 64)
    for plan in plans.values():
        for _ in range(3):
            runner.execute(plan)
    walls = {name: [] for name in plans}
    for _ in range(40):
        names = list(plans)
        random.shuffle(names)
        for name in names:
            start = time.perf_counter()
            runner.execute(plans[name])
            walls[name].append(time.perf_counter() - start)
    runner.stop_workers()
    return {f"{name} p50 ms": 1e3 * sorted(w)[len(w) // 2] for name, w in walls.items()}


def _gemm_peak() -> dict:
    """MKL's square GEMM (bench/train.py's `cpu_peak_flops`), and oneDNN's packed GEMM (what the
    serving linears run) on the bench model's shapes: each weight alone, repeated (hot in cache), and a
    whole step's 17 GEMMs in order (61 MB of weights, more than L3: streamed from memory)."""
    from train import cpu_peak_flops

    from shiftlm.model.inference_linear import PACK_ROWS

    # Q|K|V, O, gate|up, down of each layer, then the head
    shapes = [(768, 512), (512, 512), (2816, 512), (512, 1408)] * 4 + [(8000, 512)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k), PACK_ROWS) for n, k in shapes]
    out = {"one thread fp32 GEMM 512^3 best GFLOP/s (MKL)": cpu_peak_flops() / 1e9}
    for rows in (32, 160):
        inputs = {k: torch.randn(rows, k) for _, k in shapes}
        flops = [2 * rows * n * k for n, k in shapes]

        def gemm(i):
            return torch.ops.mkldnn._linear_pointwise(inputs[shapes[i][1]], packed[i], None, "none", [], "")

        hot = sum(_best(lambda i=i: gemm(i), reps=30) for i in range(len(shapes)))
        step = _best(lambda: [gemm(i) for i in range(len(shapes))], reps=30)
        out[f"oneDNN packed, {rows} rows, each weight hot GFLOP/s"] = sum(flops) / hot / 1e9
        out[f"oneDNN packed, {rows} rows, a step's weights streamed GFLOP/s"] = sum(flops) / step / 1e9
    return out


def _decode_attention_ms() -> dict:
    """The decode kernel of one layer, 32 sequences x 160 keys in scattered blocks (the bench model's
    heads): cache hot (repeated) and cold (128 MB written between calls, as a step's GEMM weights do)."""
    from shiftlm.kernels import cpu as cpu_kernels

    kernels = cpu_kernels.load()
    if kernels is None:
        return {"skipped": "the CPU kernels could not be built"}
    seqs, context, block = 32, 160, 16
    storage = torch.randn(2, 8192 * block, 2, 64)
    blocks = -(-context // block)
    tables = torch.randperm(8192)[: seqs * blocks].view(seqs, blocks).contiguous()
    q, out = torch.randn(seqs, 8, 64), torch.empty(seqs, 8, 64)
    rows, pos = torch.arange(seqs).view(seqs, 1), torch.full((seqs, 1), context - 1)
    evict = torch.ones(32 * 1024 * 1024)

    def attend():
        kernels.paged_attention(q, storage[0], storage[1], tables, rows, pos, out, block, 0)

    def cold():
        evict.mul_(1.0)
        start = time.perf_counter()
        attend()
        return time.perf_counter() - start

    hot = _best(attend, reps=40)
    return {"32 x 160 hot ms": 1e3 * hot, "32 x 160 cold ms": 1e3 * sorted(cold() for _ in range(41))[20]}


def _rope_us() -> dict:
    from shiftlm.kernels import cpu as cpu_kernels
    from shiftlm.model.rope import apply_rope_qk, rope_cos_sin

    kernels = cpu_kernels.load()
    out = {}
    for tokens in (512, 32):
        qkv = torch.randn(1, tokens, 12 * 64)
        q, k = qkv[..., :512].view(1, tokens, 8, 64), qkv[..., 512:640].view(1, tokens, 2, 64)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
        cos, sin = (
            t.unsqueeze(-2) for t in rope_cos_sin(inv_freq, torch.arange(tokens)[None], torch.float32)
        )
        with torch.no_grad():
            out[f"eager {tokens} tokens us"] = 1e6 * _best(lambda: apply_rope_qk(q, k, cos, sin), reps=200)
            if kernels is not None:
                out[f"kernel {tokens} tokens us"] = 1e6 * _best(
                    lambda: apply_rope_qk(q, k, cos, sin, kernels), reps=200
                )
    return out


def _prefill_attention_ms() -> dict:
    import torch.nn.functional as F

    from shiftlm.kernels import cpu as cpu_kernels

    kernels = cpu_kernels.load()
    out = {}
    heads, kv_heads, d, block = 8, 2, 64, 16
    for seqs, length, cached in ((4, 128, 0), (1, 512, 0), (2, 64, 100)):
        total = cached + length
        nb = total // block + 1
        k, v = torch.randn(seqs * nb * block, kv_heads, d), torch.randn(seqs * nb * block, kv_heads, d)
        q = torch.randn(seqs * length, heads, d)
        tables = torch.randperm(seqs * nb).view(seqs, nb)
        rows = torch.arange(seqs * length).view(seqs, length)
        pos = (torch.arange(length) + cached).repeat(seqs, 1)
        res = torch.empty_like(q)
        name = f"{seqs}x{length} after {cached}"
        if kernels is not None:
            out[f"kernel {name} ms"] = 1e3 * _best(
                lambda: kernels.paged_attention(q, k, v, tables, rows, pos, res, block, 0)
            )
        qq = q.view(seqs, length, heads, d).transpose(1, 2)
        if cached == 0:
            kc = (
                k.view(-1, block, kv_heads, d)[tables]
                .reshape(seqs, -1, kv_heads, d)[:, :length]
                .transpose(1, 2)
            )
            vc = (
                v.view(-1, block, kv_heads, d)[tables]
                .reshape(seqs, -1, kv_heads, d)[:, :length]
                .transpose(1, 2)
            )
            kc, vc = kc.contiguous(), vc.contiguous()
            out[f"sdpa causal {name} ms"] = 1e3 * _best(
                lambda: F.scaled_dot_product_attention(qq, kc, vc, is_causal=True, enable_gqa=True)
            )
        else:
            mask = (torch.arange(nb * block)[None, :] <= pos[0][:, None])[None, None]

            def gathered():
                kk = k.view(-1, block, kv_heads, d)[tables].reshape(seqs, -1, kv_heads, d).transpose(1, 2)
                vv = v.view(-1, block, kv_heads, d)[tables].reshape(seqs, -1, kv_heads, d).transpose(1, 2)
                return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True)

            out[f"gather + sdpa {name} ms"] = 1e3 * _best(gathered)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-dir", default=None, help="write (or reuse) the bench model here")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument("--stages", nargs="+", type=int, help="run only these (1-7, the docstring's)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from vs_vllm import make_checkpoint

    from shiftlm.launch import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.checkpoint_dir or Path(tmp) / "llama-h512")
        if not (model / "config.json").exists():
            make_checkpoint(model)
        stages = [  # (docstring item, name, run)
            (1, "all_reduce 512 floats, 2 ranks", lambda: run_ranks(_allreduce_us, 2)),
            (1, "tp2 decode step, shm", lambda: run_ranks(_tp2_steps, 2, str(model), True)),
            (1, "tp2 decode step, gloo", lambda: run_ranks(_tp2_steps, 2, str(model), False)),
            (2, "tp1 decode step by small-rows path", lambda: _tp1_steps(model)),
            (3, "rope", _rope_us),
            (4, "prefill attention per layer", _prefill_attention_ms),
            (5, "2-rank steps, tp2", lambda: run_ranks(_two_rank_steps, 2, str(model), 2, 1)),
            (
                5,
                "2-rank steps, tp1 sp2 shift runner",
                lambda: run_ranks(_two_rank_steps, 2, str(model), 1, 2),
            ),
            (6, "gemm peak", _gemm_peak),
            (7, "decode attention per layer", _decode_attention_ms),
        ]
        out = Path(args.out) / "serve_kernels.json"
        result = json.loads(out.read_text()) if args.stages and out.exists() else {}
        for item, name, run in stages:
            if args.stages and item not in args.stages:
                continue
            loadavg = os.getloadavg()
            result[name] = {
                **run(),
                "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "loadavg_before": loadavg,
            }
            if not args.json:
                print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in result[name].items()})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result) if args.json else f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
