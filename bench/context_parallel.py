"""Context parallelism vs Ulysses vs one rank as the sequence grows, at fixed tokens per step.

    python bench/context_parallel.py                       # 1k..8k tokens, ~10 minutes on 2 busy cores
    python bench/context_parallel.py --seqs 512,1024 --tokens 2048 --steps 1    # smoke run

For each sequence length S (batch = tokens / S, so every step trains the same number of tokens) it
runs forward + backward of a small Llama (GQA) three ways: one rank with the whole batch, sp = 2
(Ulysses) and cp = 2 (zigzag ring attention) on 2 local gloo ranks, each in a fresh process pool.
The three layouts' pools stay up together and their timed steps are interleaved (A, B, C, A, B,
C, ...) so that the shared cores' noise hits all alike; reported: the best of `--steps` step times
(first rank's start to last rank's end), the peak resident memory a step adds above the process
with its model built (`ru_maxrss` minus the RSS before the warm-up step; busiest rank), and the
global loss (the three must agree: the layouts compute one function). Writes bench/results/context_parallel.json and .png; prints a table. With `--sim`, adds the
simulator's prediction for a 70B Llama at 32k and 128k tokens on 64 H100s (sp = 8 vs cp = 8 vs
cp = 4 x sp = 2 at tp = 8), where the simulator knows cp.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
LAYOUTS = {"single": (1, 1), "sp2": (1, 2), "cp2": (2, 1)}  # name -> (cp, sp)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


_STATE: dict = {}  # per worker process: the model and batch of the layout it is timing


def setup(cp: int, sp: int, seq: int, batch: int, model: dict) -> None:
    """On every rank of a cp x sp layout: build the model and this rank's slice of the batch."""
    import torch

    from shiftlm.config import ModelConfig
    from shiftlm.mesh import Mesh
    from shiftlm.model import build_model
    from shiftlm.model.ring_attention import sequence_indices
    from shiftlm.parallel import ParallelConfig

    torch.set_num_threads(1)
    config = ModelConfig(**model, max_position_embeddings=max(seq, 2048))
    mesh = Mesh(ParallelConfig(cp=cp, sp=sp))
    net = build_model(config, mesh, seed=0)
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    index = torch.from_numpy(sequence_indices(seq, cp, mesh.cp.rank, sp, mesh.sp.rank))
    _STATE.update(
        mesh=mesh, net=net, inputs=ids[:, :-1][:, index], targets=ids[:, 1:][:, index], tokens=batch * seq
    )
    _STATE["base"] = _rss_bytes()  # the model and batch are in place; a step adds the rest
    step()  # warm-up


def step() -> float:
    """One forward + backward; seconds from the first rank's start to the last rank's end."""
    import torch.distributed as dist

    s = _STATE
    distributed = s["mesh"].world_size > 1
    if distributed:
        dist.barrier()
    start = time.perf_counter()
    s["net"].zero_grad(set_to_none=True)
    s["loss"] = s["net"].loss(s["net"](s["inputs"]), s["targets"]).sum() / s["tokens"]
    s["loss"].backward()
    if distributed:
        dist.barrier()
    return time.perf_counter() - start


def finish() -> dict:
    """Peak resident memory steps added above the built model, and the global loss."""
    from shiftlm.comm import all_reduce

    s = _STATE
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - s["base"]
    total = all_reduce(s["loss"].detach().reshape(1), s["mesh"].dp_sp).item()
    _STATE.clear()
    return {"peak_bytes": peak, "loss": total}


def run_layouts(args) -> list[dict]:
    """Per sequence length: one fresh pool per layout (so a process's high-water mark is its own),
    then the timed steps interleaved across the layouts so that machine noise hits all alike."""
    from shiftlm.launch import LocalWorkers

    model = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
    )
    rows = []
    for seq in args.seqs:
        batch = args.tokens // seq
        row = {"seq_len": seq, "batch": batch, "tokens": batch * seq}
        pools = {name: LocalWorkers(cp * sp, timeout=args.timeout) for name, (cp, sp) in LAYOUTS.items()}
        try:
            for name, (cp, sp) in LAYOUTS.items():
                pools[name].run(setup, cp, sp, seq, batch, model)
            times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
            for _ in range(args.steps):
                for name in LAYOUTS:
                    times[name].append(max(pools[name].run(step)))
            for name in LAYOUTS:
                per_rank = pools[name].run(finish)
                row[name] = {
                    "step_s": round(min(times[name]), 4),
                    "step_s_all": [round(t, 4) for t in times[name]],
                    "peak_mib": round(max(r["peak_bytes"] for r in per_rank) / 2**20, 1),
                    "loss": per_rank[0]["loss"],
                }
        finally:
            for pool in pools.values():
                pool.close()
        rows.append(row)
        print(_format_row(row), flush=True)
    return rows


def _format_row(row: dict) -> str:
    cells = [f"{row['seq_len']:>6} x{row['batch']:<3}"]
    for name in LAYOUTS:
        r = row[name]
        cells.append(f"{name}: {r['step_s']:7.2f} s {r['peak_mib']:7.1f} MiB")
    losses = [row[name]["loss"] for name in LAYOUTS]
    cells.append(f"loss spread {max(losses) - min(losses):.1e}")
    return " | ".join(cells)


SIM_LAYOUTS = {"tp8_sp8": (1, 8), "tp8_cp8": (8, 1), "tp8_cp4_sp2": (4, 2)}  # name -> (cp, sp)


def simulate_70b() -> list[dict]:
    """The simulator's step time and memory for Llama-3 70B at 32k / 128k tokens on 64 H100s (8 per
    node, fitted efficiencies), 8 sequences per step, full recomputation, ZeRO-1."""
    from shiftlm.hardware import CATALOG
    from shiftlm.presets import PRESETS
    from shiftlm.sim.efficiency import FITTED
    from shiftlm.sim.layout import Layout
    from shiftlm.sim.train import simulate_step

    rows = []
    for seq in (32768, 131072):
        for name, (cp, sp) in SIM_LAYOUTS.items():
            layout = Layout(
                tp=8,
                sp=sp,
                cp=cp,
                global_batch=8,
                seq_len=seq,
                schedule="none",
                recompute="full",
                sequence_parallel=False,
            )
            result = simulate_step(PRESETS["llama3-70b"], layout, CATALOG["h100-sxm"], FITTED).as_dict()
            rows.append({"seq_len": seq, "layout": name, **result})
            mem = result["memory_gib"]
            print(
                f"sim 70B {seq:>6} {name:<12} step {result['step_time_s']:6.2f} s  MFU {100 * result['mfu']:4.1f}%  "
                f"tp/sp/ring comm {result['breakdown_s']['tp_sp_comm']:5.2f} s  memory {mem['total']} GiB "
                f"(activations {mem['activations']})",
                flush=True,
            )
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    seqs = [r["seq_len"] for r in rows]
    for name in LAYOUTS:
        left.plot(seqs, [r[name]["step_s"] for r in rows], marker="o", label=name)
        right.plot(seqs, [r[name]["peak_mib"] for r in rows], marker="o", label=name)
    for axis, label in ((left, "step time (s)"), (right, "peak step memory (MiB, busiest rank)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel(f"sequence length (batch x seq = {rows[0]['tokens']} tokens per step)")
        axis.set_ylabel(label)
        axis.legend()
        axis.grid(alpha=0.3)
    fig.suptitle("one rank vs Ulysses sp=2 vs ring attention cp=2 (gloo, CPU, shared cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="1024,2048,4096,8192")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per step (batch x seq)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--sim", action="store_true", help="add the simulator's 70B / 64 x H100 prediction")
    parser.add_argument("--sim-only", action="store_true", help="keep the measured rows of --out, redo --sim")
    parser.add_argument("--out", default=str(RESULTS / "context_parallel.json"))
    parser.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    args = parser.parse_args(argv)
    args.seqs = [int(s) for s in args.seqs.split(",")]
    for seq in args.seqs:
        if seq % 4 or args.tokens % seq:
            parser.error(f"sequence {seq}: must be a multiple of 4 (2*cp) and divide --tokens {args.tokens}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.sim_only:
        report = json.loads(out.read_text())
        rows = report["rows"]
    else:
        print(
            f"{args.tokens} tokens per step, steps {args.steps} (+1 warm-up), loadavg {_loadavg()}",
            flush=True,
        )
        rows = run_layouts(args)
        report = {
            "tokens_per_step": args.tokens,
            "model": {k: getattr(args, k) for k in ("hidden", "heads", "kv_heads", "ffn", "layers", "vocab")},
            "loadavg_end": _loadavg(),
            "rows": rows,
        }
    if args.sim or args.sim_only:
        report["simulated_70b_64xh100"] = simulate_70b()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    plot(rows, out.with_suffix(".png"))
    if args.json:
        print(json.dumps(report))
    return 0


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


if __name__ == "__main__":
    raise SystemExit(main())
