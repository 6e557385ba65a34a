"""Shift Parallelism on 2 local CPU ranks: one scaled Azure code-trace slice against full TP, SP x TP and
shift, at two request rates, in one run. Prints a table, writes JSON and a latency-throughput plot.

    python bench/serve_modes.py                      # ~3 minutes on 2 cores
    python bench/serve_modes.py --out runs/serve_modes --rates 2 6 --max-requests 40

The model is the tiny random llama-gqa checkpoint (hidden 64, 2 layers) with a character tokenizer;
each mode gets its own `shiftlm serve --tp 1 --sp 2 --mode ...` process.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from shiftlm.model.tiny import make_tiny_checkpoint
from shiftlm.serve.local_server import local_server
from shiftlm.serve.replay import bench_url
from shiftlm.serve.tokenizer import write_char_tokenizer
from shiftlm.serve.trace import load_trace, scale_trace

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "traces" / "azure_llm_2023_code.csv"
MODES = ("tp", "sp_tp", "shift")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for mode in MODES:
        points = sorted(
            (r["output_token_throughput"], r["ttft"]["mean_ms"], r["tpot"]["mean_ms"])
            for r in rows
            if r["mode"] == mode
        )
        axes[0].plot([p[0] for p in points], [p[1] for p in points], marker="o", label=mode)
        axes[1].plot([p[0] for p in points], [p[2] for p in points], marker="o", label=mode)
    axes[0].set(xlabel="output tokens/s", ylabel="mean TTFT (ms)", title="TTFT vs throughput")
    axes[1].set(xlabel="output tokens/s", ylabel="mean TPOT (ms)", title="TPOT vs throughput")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/serve_modes")
    parser.add_argument("--rates", type=float, nargs="+", default=[2.0, 8.0], help="requests/s")
    parser.add_argument("--max-requests", type=int, default=40)
    parser.add_argument("--max-input", type=int, default=192)  # + output < 256 context
    parser.add_argument("--max-output", type=int, default=16)
    parser.add_argument("--shift-threshold", type=int, default=32)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = load_trace(TRACE)
    replay_args = argparse.Namespace(model_name=None, timeout=300.0, slo_ttft=1.0, slo_tpot=0.1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint(Path(tmp) / "tiny", "llama-gqa")
        write_char_tokenizer(model_dir, vocab_size=250)
        for mode in MODES:
            serve = [
                "--model",
                str(model_dir),
                "--tp",
                "1",
                "--sp",
                "2",
                "--mode",
                mode,
                "--shift-threshold",
                str(args.shift_threshold),
                "--num-blocks",
                "512",
                "--block-size",
                "16",
            ]
            with local_server(serve, log_path=str(out / f"server_{mode}.log")) as url:
                for rate in args.rates:
                    requests = scale_trace(
                        trace,
                        0,
                        args.max_requests,
                        rate=rate,
                        max_input=args.max_input,
                        max_output=args.max_output,
                    )
                    summary, _ = bench_url(url, requests, replay_args)
                    rows.append({"mode": mode, "rate": rate, **summary})
                    print(
                        f"{mode:6s} rate {rate:4.1f}/s  TTFT {summary['ttft']['mean_ms']:7.1f} ms "
                        f"(p90 {summary['ttft']['p90_ms']:7.1f})  TPOT {summary['tpot']['mean_ms']:6.1f} ms  "
                        f"{summary['output_token_throughput']:6.1f} tok/s  {summary['completed']}/"
                        f"{summary['requests']} ok",
                        flush=True,
                    )
    (out / "serve_modes.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    plot(rows, out / "serve_modes.png")
    print(f"wrote {out / 'serve_modes.json'} and {out / 'serve_modes.png'}")


if __name__ == "__main__":
    main()
