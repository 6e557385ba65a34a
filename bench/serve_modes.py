"""Shift Parallelism on 2 local CPU ranks: one scaled Azure code-trace slice against full TP, SP x TP and
shift, at two request rates, interleaved in time. Prints per-mode latency and step-time tables, writes
bench/results/serve_modes.json and .png.

    python bench/serve_modes.py                      # ~5 minutes on 2 cores
    python bench/serve_modes.py --rates 2 6 --max-requests 40 --repeats 2

The model is the tiny random llama-gqa checkpoint (hidden 64, 2 layers) with a character tokenizer.
The three servers (`shiftlm serve --tp 1 --sp 2 --mode ...`) run side by side and every (rate, repeat)
round replays the slice against each of them in turn, the order rotating every round, so that load
from other jobs on the machine falls on all modes alike; compare modes by ratios within this run.
Every replay uses its own prompt token range (no prefix-cache hits across replays), and each server
first gets one discarded warm-up replay. Each server logs its steps (`--step-log`): the step-time
table compares the model time of steps of the same size in each mode. The switch cost is measured
apart, in-process on 2 ranks: the same 8-sequence decode step, timed after a step of the same plan
in the same mode or in the other mode (random pair order).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from shiftlm.data import trace_path
from shiftlm.launch import LocalWorkers
from shiftlm.serve.engine.tokenizer import write_char_tokenizer
from shiftlm.serve.local_server import local_server
from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan
from shiftlm.serve.replay import bench_url, steps_so_far
from shiftlm.serve.trace import load_trace, scale_trace
from shiftlm.tools.tiny import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TRACE = trace_path("azure_code")
MODES = ("tp", "sp_tp", "shift")
TOKEN_BUCKETS = ((1, 8), (9, 32), (33, 128), (129, 256))  # step sizes compared across modes
PROMPT_ID_RANGE = 50  # replay.synthetic_prompt draws ids from [first_id, first_id + 50)


def step_table(steps: dict[str, list[dict]]) -> list[dict]:
    """Median model ms per (server mode, step mode, token bucket)."""
    rows = []
    for server_mode, log in steps.items():
        if log:  # the whole run: total model time is what the scheduler's decisions cost in this mode
            rows.append(_row(server_mode, "all", "all", [step["seconds"] for step in log]))
        for low, high in TOKEN_BUCKETS:
            for step_mode in ("tp", "sp_tp"):
                times = [s["seconds"] for s in log if s["mode"] == step_mode and low <= s["tokens"] <= high]
                if times:
                    rows.append(_row(server_mode, step_mode, f"{low}-{high}", times))
    return rows


def _row(server_mode: str, step_mode: str, tokens: str, times: list[float]) -> dict:
    return {
        "server": server_mode,
        "step_mode": step_mode,
        "tokens": tokens,
        "steps": len(times),
        "median_ms": 1e3 * statistics.median(times),
        "mean_ms": 1e3 * statistics.fmean(times),
        "total_s": sum(times),
    }


def switch_cost(model_dir: str, repeats: int) -> dict[str, float] | None:
    """Median ms of a decode step (8 sequences, 100 tokens of context) by (its mode, the previous step's)."""
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    mesh = Mesh(ParallelConfig(tp=1, sp=2))
    runner = ModelRunner.load(model_dir, mesh, num_blocks=64, block_size=16)
    chunks = tuple(
        ScheduledChunk(i, (5,), 100, tuple(range(7 * i, 7 * i + 7)), True, row=i) for i in range(8)
    )
    pairs = [(before, after) for before in Mode for after in Mode] * repeats
    random.Random(0).shuffle(pairs)  # the same order on both ranks
    times: dict[str, list[float]] = {}
    for before, after in pairs:
        runner.run_step(StepPlan(0, before, chunks))
        started = time.perf_counter()
        runner.run_step(StepPlan(1, after, chunks))
        times.setdefault(f"{after.value} after {before.value}", []).append(time.perf_counter() - started)
    return {key: 1e3 * statistics.median(values) for key, values in sorted(times.items())}


def mean_over_repeats(rows: list[dict]) -> list[dict]:
    """One row per (mode, rate): latency means averaged over the repeats."""
    merged = []
    for mode in MODES:
        for rate in sorted({r["rate"] for r in rows}):
            runs = [r for r in rows if r["mode"] == mode and r["rate"] == rate]
            merged.append(
                {
                    "mode": mode,
                    "rate": rate,
                    "ttft_ms": statistics.fmean(r["ttft"]["mean_ms"] for r in runs),
                    "ttft_p90_ms": statistics.fmean(r["ttft"]["p90_ms"] for r in runs),
                    "tpot_ms": statistics.fmean(r["tpot"]["mean_ms"] for r in runs),
                    "tok_s": statistics.fmean(r["output_token_throughput"] for r in runs),
                }
            )
    return merged


def plot(summary: list[dict], steps: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for mode in MODES:
        points = sorted((r["rate"], r["ttft_ms"], r["tpot_ms"]) for r in summary if r["mode"] == mode)
        axes[0].plot([p[0] for p in points], [p[1] for p in points], marker="o", label=mode)
        axes[1].plot([p[0] for p in points], [p[2] for p in points], marker="o", label=mode)
    axes[0].set(xlabel="requests/s", ylabel="mean TTFT (ms)", title="TTFT (mean of repeats)")
    axes[1].set(xlabel="requests/s", ylabel="mean TPOT (ms)", title="TPOT (mean of repeats)")
    buckets = [f"{low}-{high}" for low, high in TOKEN_BUCKETS]
    for server, step_mode in (("tp", "tp"), ("sp_tp", "sp_tp"), ("shift", "tp"), ("shift", "sp_tp")):
        by_bucket = {
            r["tokens"]: r["median_ms"] for r in steps if (r["server"], r["step_mode"]) == (server, step_mode)
        }
        xs = [i for i, b in enumerate(buckets) if b in by_bucket]
        axes[2].plot(
            xs, [by_bucket[buckets[i]] for i in xs], marker="o", label=f"{server} server, {step_mode} steps"
        )
    axes[2].set(xticks=range(len(buckets)), xticklabels=buckets, xlabel="tokens in the step")
    axes[2].set(ylabel="median model time (ms)", title="step time by mode")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--rates", type=float, nargs="+", default=[2.0, 8.0], help="requests/s")
    parser.add_argument("--repeats", type=int, default=2, help="rounds per rate (modes rotate each round)")
    parser.add_argument("--max-requests", type=int, default=40)
    parser.add_argument("--max-input", type=int, default=192)  # + output < 256 context
    parser.add_argument("--max-output", type=int, default=16)
    parser.add_argument("--shift-threshold", type=int, default=32)
    parser.add_argument("--switch-repeats", type=int, default=60, help="timed pairs per (mode, mode)")
    parser.add_argument(
        "--step-log-dir",
        type=Path,
        help="keep each server's step log here (steps_MODE.jsonl, warm-up included)",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = load_trace(TRACE)
    replay_args = argparse.Namespace(model_name=None, timeout=300.0, slo_ttft=1.0, slo_tpot=0.1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as servers:
        model_dir = make_tiny_checkpoint(Path(tmp) / "tiny", "llama-gqa")
        write_char_tokenizer(model_dir, vocab_size=250)
        step_logs = {mode: Path(tmp) / f"steps_{mode}.jsonl" for mode in MODES}
        urls = {}
        for mode in MODES:
            serve = ["--model", str(model_dir), "--tp", "1", "--sp", "2", "--mode", mode]
            serve += [
                "--shift-threshold",
                str(args.shift_threshold),
                "--num-blocks",
                "512",
                "--block-size",
                "16",
            ]
            serve += ["--step-log", str(step_logs[mode])]
            urls[mode] = servers.enter_context(local_server(serve)).url
        rounds = [(repeat, rate) for repeat in range(args.repeats) for rate in args.rates]
        if PROMPT_ID_RANGE * (len(rounds) + 1) > 250:
            parser.error("at most 4 rounds (repeats x rates) fit the tiny model's 250-token vocabulary")
        warmup = scale_trace(trace, 0, 8, rate=4.0, max_input=args.max_input, max_output=args.max_output)
        warmup_steps = {}
        for mode in MODES:  # first-use costs (allocations, gloo buffers) go into discarded steps
            bench_url(urls[mode], warmup, replay_args, first_id=PROMPT_ID_RANGE * len(rounds))
            warmup_steps[mode] = steps_so_far(urls[mode])
        for index, (repeat, rate) in enumerate(rounds):
            requests = scale_trace(
                trace, 0, args.max_requests, rate=rate, max_input=args.max_input, max_output=args.max_output
            )
            for mode in MODES[index % 3 :] + MODES[: index % 3]:
                summary, _ = bench_url(urls[mode], requests, replay_args, first_id=PROMPT_ID_RANGE * index)
                rows.append({"mode": mode, "rate": rate, "repeat": repeat, **summary})
                print(
                    f"{mode:6s} rate {rate:4.1f}/s #{repeat}  TTFT {summary['ttft']['mean_ms']:7.1f} ms "
                    f"(p90 {summary['ttft']['p90_ms']:7.1f})  TPOT {summary['tpot']['mean_ms']:6.1f} ms  "
                    f"{summary['output_token_throughput']:6.1f} tok/s  {summary['completed']}/{summary['requests']} ok",
                    flush=True,
                )
        servers.close()  # flushes the step logs
        logs = {mode: [json.loads(line) for line in step_logs[mode].open()] for mode in MODES}
        if args.step_log_dir is not None:
            args.step_log_dir.mkdir(parents=True, exist_ok=True)
            for mode in MODES:
                (args.step_log_dir / f"steps_{mode}.jsonl").write_text(step_logs[mode].read_text())
        steps = step_table(
            {mode: [s for s in log if s["step"] >= warmup_steps[mode]] for mode, log in logs.items()}
        )
        with LocalWorkers(2) as workers:
            switches = workers.run(switch_cost, str(model_dir), args.switch_repeats)[0]
    summary = mean_over_repeats(rows)
    print("\nmode   rate  TTFT ms (p90)    TPOT ms  tok/s   [mean of repeats]")
    for r in summary:
        print(
            f"{r['mode']:6s} {r['rate']:4.1f}  {r['ttft_ms']:6.1f} ({r['ttft_p90_ms']:6.1f})  {r['tpot_ms']:7.1f}  {r['tok_s']:5.1f}"
        )
    print("\nserver step   tokens              steps  median ms  mean ms  total s")
    for r in steps:
        print(
            f"{r['server']:6s} {r['step_mode']:6s} {r['tokens']:18s} {r['steps']:5d}  {r['median_ms']:9.2f}  {r['mean_ms']:7.2f}  {r['total_s']:7.2f}"
        )
    print("\ndecode step (8 seqs) median ms, by the previous step's mode:")
    for key, ms in switches.items():
        print(f"  {key:16s} {ms:6.2f}")
    results = {
        "args": {**vars(args), "step_log_dir": args.step_log_dir and str(args.step_log_dir)},
        "summary": summary,
        "step_times": steps,
        "switch_cost_ms": switches,
    }
    (out / "serve_modes.json").write_text(json.dumps({**results, "runs": rows}, indent=1))
    plot(summary, steps, out / "serve_modes.png")
    print(f"wrote {out / 'serve_modes.json'} and {out / 'serve_modes.png'}")


if __name__ == "__main__":
    main()
