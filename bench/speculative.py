"""Speculative decoding (`--speculative-config`: ngram, suffix) against decoding without it, and
against `transformers`' own prompt lookup decoding, on the same trained model and the same prompts.

    shiftlm quickstart --out quickstart                    # the trained model (Python source)
    python bench/speculative.py --model quickstart/hf      # ~8 minutes on 2 CPU cores

The work: `--requests` prompts cut from the Python standard library's source (what the quickstart
model was trained on: code repeats itself, which is what the drafts find), each a function's first
`--prompt-lines` lines after the 40 lines before it, continued greedily for `--max-tokens` tokens
(EOS ignored). For shiftlm (`LLM`, one rank, its default flags), each of `--methods` (off, ngram:K,
suffix), a fresh engine each round:
- the prompts one at a time: tokens/s and time per output token (the latency drafts are for);
- then the same prompts again, all in one batch: output tokens/s (throughput, where drafts cost
  verification work; for suffix, a repeat its cache of finished outputs has seen, as agents repeat);
- the draft acceptance rate and the mean tokens per sample step (1 + kept drafts per step).
For `transformers` (`generate`, fp32, eager): one prompt at a time, plain and with
`prompt_lookup_num_tokens=K` for each ngram:K. Greedy output must be the same everywhere: every
run's tokens are compared with shiftlm's without drafts, and mismatches are counted in the JSON.
Rounds alternate the configurations; medians over rounds. Writes bench/results/speculative.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def stdlib_prompts(tokenizer, count: int, lines: int) -> list[list[int]]:
    """`count` prompts: a function's first `lines` lines with the 40 lines before it, from sorted
    stdlib files (every 7th function, so they spread over many files)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts, seen = [], 0
    for path in sorted(stdlib.glob("*.py")):
        source = path.read_text(errors="replace").splitlines()
        for i, line in enumerate(source):
            if line.lstrip().startswith("def ") and i >= 40:
                seen += 1
                if seen % 7 == 0:
                    prompts.append(tokenizer.encode("\n".join(source[i - 40 : i + lines]) + "\n"))
                    if len(prompts) == count:
                        return prompts
    return prompts


def spec_config(method: str) -> dict | None:
    """`off`, `ngram:K` (lookups of 1-3 tokens, as transformers' max_matching_ngram_size=3) or
    `suffix` (vLLM's defaults)."""
    if method == "off":
        return None
    if method == "suffix":
        return {"method": "suffix"}
    name, k = method.split(":")
    return {"method": name, "num_speculative_tokens": int(k), "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def lookup_k(method: str) -> int:
    """transformers' `prompt_lookup_num_tokens` for the same work: ngram's k, else 0 (plain)."""
    return int(method.split(":")[1]) if method.startswith("ngram:") else 0


def time_shiftlm(model: str, method: str, prompts, max_tokens: int, rounds: int) -> dict:
    from shiftlm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    serial, batch, tokens = [], [], None
    with LLM(model, speculative_config=spec_config(method)) as llm:
        llm.generate(prompts[0], params)  # warm: compiled steps, allocator
        metrics = llm._engine.metrics
        before = metrics.speculation_counts()
        for _ in range(rounds):
            started = time.perf_counter()
            outs = [llm.generate(p, params)[0] for p in prompts]
            serial.append(time.perf_counter() - started)
            tokens = [o.outputs[0].token_ids for o in outs]
            started = time.perf_counter()
            llm.generate(prompts, params)
            batch.append(time.perf_counter() - started)
        drafts, draft_tokens, accepted = (b - a for a, b in zip(before, metrics.speculation_counts()))
    total = len(prompts) * max_tokens
    return {
        "method": method,
        "serial_tokens_per_s": total / statistics.median(serial),
        "tpot_ms": 1000 * statistics.median(serial) / total,
        "batch_tokens_per_s": total / statistics.median(batch),
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "tokens_per_sample_step": 1 + accepted / drafts if drafts else 1.0,
        "serial_seconds": serial,
        "batch_seconds": batch,
        "tokens": tokens,
    }


def time_transformers(model: str, k: int, prompts, max_tokens: int, rounds: int) -> dict:
    """`generate` one prompt at a time, plain (k=0) or with `prompt_lookup_num_tokens=k`."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # as ignore_eos
    extra = {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": 3} if k else {}

    def one(prompt):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, **extra)
        return out[0, len(prompt) :].tolist()

    one(prompts[0])
    serial, tokens = [], None
    for _ in range(rounds):
        started = time.perf_counter()
        tokens = [one(p) for p in prompts]
        serial.append(time.perf_counter() - started)
    total = len(prompts) * max_tokens
    return {
        "serial_tokens_per_s": total / statistics.median(serial),
        "tpot_ms": 1000 * statistics.median(serial) / total,
        "serial_seconds": serial,
        "tokens": tokens,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.8))
    rows = result["shiftlm"]
    width, xs = 0.27, range(len(rows))
    hf = {row["lookup_k"]: row for row in result["transformers"]}
    ax.bar([x - width for x in xs], [r["serial_tokens_per_s"] for r in rows], width,
           label="shiftlm, one request at a time")  # fmt: skip
    ax.bar(list(xs), [r["batch_tokens_per_s"] for r in rows], width,
           label=f"shiftlm, {result['requests']} at once (the same prompts again)")  # fmt: skip
    ax.bar([x + width for x in xs], [hf[lookup_k(r["method"])]["serial_tokens_per_s"] for r in rows], width,
           label="transformers generate, one at a time (prompt lookup k for ngram:k)")  # fmt: skip
    ax.set_xticks(list(xs), [r["method"] for r in rows])
    ax.set_ylabel("output tokens/s")
    ax.set_title("speculative decoding, quickstart model, greedy, 2 CPU cores")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(ROOT / "quickstart" / "hf"), help="a trained checkpoint")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-lines", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--methods", default="off,ngram:2,ngram:4,suffix", help="off, ngram:K, suffix (comma-separated)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "speculative.json"))
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args()
    if not (Path(args.model) / "config.json").is_file():
        print(f"bench/speculative.py: no checkpoint at {args.model}; make one with: shiftlm quickstart "
              "--out quickstart (then --model quickstart/hf)", file=sys.stderr)  # fmt: skip
        return 2
    from shiftlm.serve.engine.tokenizer import load_tokenizer

    prompts = stdlib_prompts(load_tokenizer(args.model), args.requests, args.prompt_lines)
    methods = args.methods.split(",")
    if "off" not in methods:
        methods.insert(0, "off")  # the baseline every ratio is over
    ks = sorted({lookup_k(m) for m in methods})
    ours, theirs = {m: [] for m in methods}, {k: [] for k in ks}
    load = os.getloadavg()
    for round_ in range(args.rounds):  # each round: every configuration once, in turn
        for method in methods:
            ours[method].append(time_shiftlm(args.model, method, prompts, args.max_tokens, 1))
            print(f"round {round_ + 1}/{args.rounds} {method}: shiftlm {ours[method][-1]['serial_tokens_per_s']:.0f} "
                  f"tok/s serial, {ours[method][-1]['batch_tokens_per_s']:.0f} batch", file=sys.stderr, flush=True)  # fmt: skip
        for k in ks:
            theirs[k].append(time_transformers(args.model, k, prompts, args.max_tokens, 1))
            print(f"round {round_ + 1}/{args.rounds} transformers lookup k={k}: "
                  f"{theirs[k][-1]['serial_tokens_per_s']:.0f} tok/s serial", file=sys.stderr, flush=True)  # fmt: skip

    def merged(runs: list[dict]) -> dict:
        row = dict(runs[-1])
        for key in ("serial_tokens_per_s", "batch_tokens_per_s", "tpot_ms"):
            if key in row:
                row[key] = statistics.median(r[key] for r in runs)
                best = min if key == "tpot_ms" else max  # a busy machine only ever slows a round
                row[f"best_{key}"] = best(r[key] for r in runs)
        row["rounds"] = [{k: r[k] for k in r if k != "tokens"} for r in runs]
        row["mismatched_requests"] = sum(
            tokens != ref for run in runs for tokens, ref in zip(run["tokens"], reference)
        )
        del row["tokens"]
        return row

    reference = ours["off"][0]["tokens"]
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "model": args.model,
        "torch": torch.__version__,
        "requests": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "max_tokens": args.max_tokens,
        "load_average_before": load,
        "shiftlm": [merged(ours[m]) for m in methods],
        "transformers": [{"lookup_k": k, **merged(theirs[k])} for k in ks],
    }
    base = result["shiftlm"][0]
    hf = {row["lookup_k"]: row for row in result["transformers"]}
    for row in result["shiftlm"]:
        row["serial_speedup"] = row["serial_tokens_per_s"] / base["serial_tokens_per_s"]
        row["batch_speedup"] = row["batch_tokens_per_s"] / base["batch_tokens_per_s"]
        row["vs_transformers"] = (
            row["serial_tokens_per_s"] / hf[lookup_k(row["method"])]["serial_tokens_per_s"]
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{'':10}{'serial tok/s':>13}{'x off':>7}{'batch tok/s':>12}{'x off':>7}{'accept':>8}"
              f"{'tok/step':>9}{'HF tok/s':>9}{'x HF':>6}{'mismatch':>9}")  # fmt: skip
        for row in result["shiftlm"]:
            theirs_row = hf[lookup_k(row["method"])]
            rate = "-" if row["acceptance_rate"] is None else f"{100 * row['acceptance_rate']:.0f}%"
            print(f"{row['method']:10}{row['serial_tokens_per_s']:13.0f}{row['serial_speedup']:7.2f}"
                  f"{row['batch_tokens_per_s']:12.0f}{row['batch_speedup']:7.2f}{rate:>8}"
                  f"{row['tokens_per_sample_step']:9.2f}{theirs_row['serial_tokens_per_s']:9.0f}"
                  f"{row['vs_transformers']:6.2f}{row['mismatched_requests'] + theirs_row['mismatched_requests']:9d}")  # fmt: skip
        print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
