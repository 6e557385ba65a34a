"""`shiftlm bench serve`: replay a trace against a server and report serving latency and throughput.

    shiftlm bench serve --trace azure_code --model DIR --tp 1 --sp 2 \\
        --max-requests 40 --rate 2 --max-input 128 --max-output 16 --out runs/replay --json

Each request streams from /v1/completions with a synthetic prompt of the trace's length (token ids) and
`ignore_eos` + `max_tokens` set to the trace's output length. Definitions (as in vLLM's benchmarks):
TTFT = first chunk - send; TPOT = (E2E - TTFT) / (output tokens - 1); ITL = gaps between chunks;
goodput = requests per second that meet both the TTFT and the TPOT SLO.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shiftlm.errors import ConfigError
from shiftlm.serve.trace import TraceRequest, load_trace, scale_trace, synthetic_prompt


@dataclass
class RequestResult:
    arrival: float
    input_len: int
    output_len: int
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_len - 1) if self.ok and self.output_len > 1 else None


async def _one(
    http, url: str, model: str, index: int, request: TraceRequest, start: float, first_id: int
) -> RequestResult:
    import httpx

    result = RequestResult(request.arrival, request.input_len, request.output_len)
    await asyncio.sleep(max(0.0, start + request.arrival - time.perf_counter()))
    body = {
        "model": model,
        "prompt": synthetic_prompt(index, request.input_len, first_id),
        "max_tokens": request.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    sent = last = time.perf_counter()
    chunks = 0
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - sent
                else:
                    result.itls.append(now - last)
                last, chunks = now, chunks + 1
        result.e2e = last - sent
        result.ok = chunks == request.output_len
        result.error = "" if result.ok else f"got {chunks} tokens, expected {request.output_len}"
    except httpx.HTTPError as err:
        result.error = repr(err)
    return result


async def replay(
    url: str, model: str, requests: list[TraceRequest], timeout: float, first_id: int = 3
) -> list[RequestResult]:
    """Send every request at its arrival time (open loop); wait for all, at most `timeout` seconds.

    Prompts use token ids [first_id, first_id + 50): replays with disjoint ranges share no prefix, so
    a second replay against the same server does not hit the first one's prefix cache."""
    import httpx

    limits = httpx.Limits(max_connections=len(requests) + 1)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        start = time.perf_counter()
        tasks = [_one(http, url, model, i, r, start, first_id) for i, r in enumerate(requests)]
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout)


def _percentiles(values: list[float]) -> dict[str, float]:
    import numpy as np

    if not values:
        return {
            "mean_ms": float("nan"),
            "p50_ms": float("nan"),
            "p90_ms": float("nan"),
            "p99_ms": float("nan"),
        }
    data = np.asarray(values) * 1000.0
    return {
        "mean_ms": float(data.mean()),
        **{f"p{q}_ms": float(np.percentile(data, q)) for q in (50, 90, 99)},
    }


def summarize(results: list[RequestResult], duration: float, slo_ttft: float, slo_tpot: float) -> dict:
    ok = [r for r in results if r.ok]
    good = [r for r in ok if r.ttft <= slo_ttft and (r.tpot is None or r.tpot <= slo_tpot)]
    output_tokens = sum(r.output_len for r in ok)
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + sum(r.input_len for r in ok)) / duration,
        "goodput": len(good) / duration,
        "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot},
        "ttft": _percentiles([r.ttft for r in ok]),
        "tpot": _percentiles([r.tpot for r in ok if r.tpot is not None]),
        "itl": _percentiles([gap for r in ok for gap in r.itls]),
        "e2e": _percentiles([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def plot_latency_over_time(results: list[RequestResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.scatter([r.arrival for r in ok], [r.ttft * 1000 for r in ok], s=10, label="TTFT")
    ax.scatter([r.arrival for r in ok], [r.e2e * 1000 for r in ok], s=10, label="E2E")
    ax.set(xlabel="arrival time (s)", ylabel="latency (ms)", title=title, yscale="log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def steps_so_far(url: str) -> int:
    """Engine steps a server has run (its `--step-log` numbers them from 0), from its /metrics."""
    import urllib.request

    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    return sum(
        int(float(line.split()[-1])) for line in text.splitlines() if line.startswith("shiftlm_steps_")
    )


def first_model(url: str) -> str:
    """The first model a server lists; a server that cannot be reached or answers otherwise is one
    line naming the URL and the fix (ConfigError), not an httpx traceback."""
    import httpx

    try:
        response = httpx.get(f"{url}/v1/models", timeout=30)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as err:
        reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no answer'}"
        raise ConfigError(
            f"no OpenAI server answers GET {url}/v1/models ({reason}); start one (shiftlm serve --model DIR), "
            "or fix --url, or pass --model DIR to start one here"
        ) from None


def bench_url(
    url: str, requests: list[TraceRequest], args: argparse.Namespace, first_id: int = 3
) -> tuple[dict, list[RequestResult]]:
    model = args.model_name or first_model(url)
    start = time.perf_counter()
    results = asyncio.run(replay(url, model, requests, args.timeout, first_id))
    return summarize(results, time.perf_counter() - start, args.slo_ttft, args.slo_tpot), results


def serve_args(args: argparse.Namespace) -> list[str]:
    """`shiftlm serve` arguments from the engine options of `bench serve --model ...`."""
    names = (
        "model",
        "tp",
        "sp",
        "mode",
        "shift_threshold",
        "num_blocks",
        "block_size",
        "max_num_seqs",
        "max_tokens_per_step",
        "max_pending",
    )
    flags = [part for name in names for part in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]
    return flags + ([] if getattr(args, "enable_prefix_caching", True) else ["--no-enable-prefix-caching"])


def run_bench(args: argparse.Namespace) -> int:
    from shiftlm.serve.local_server import local_server

    if args.timeout <= 0:
        raise ValueError(f"--timeout {args.timeout} must be > 0 seconds")
    requests = scale_trace(
        load_trace(args.trace),
        args.start,
        args.max_requests,
        args.time_scale,
        args.rate,
        args.max_input,
        args.max_output,
    )
    if args.model:
        with local_server(serve_args(args)) as server:
            summary, results = bench_url(server.url, requests, args)
    else:
        summary, results = bench_url(args.url, requests, args)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(
            json.dumps({"summary": summary, "requests": [asdict(r) for r in results]})
        )
        plot_latency_over_time(results, out / "latency_over_time.png", Path(args.trace).name)
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"{summary['completed']}/{summary['requests']} requests in {summary['duration_s']:.1f}s: "
            f"{summary['request_throughput']:.2f} req/s, {summary['output_token_throughput']:.1f} output tokens/s, "
            f"goodput {summary['goodput']:.2f} req/s (TTFT <= {1000 * summary['slo']['ttft_s']:.0f} ms "
            f"and TPOT <= {1000 * summary['slo']['tpot_s']:.0f} ms)"
        )
        for metric in ("ttft", "tpot", "itl", "e2e"):
            row = summary[metric]
            print(
                f"  {metric:5s} mean {row['mean_ms']:8.1f} ms  p50 {row['p50_ms']:8.1f}  "
                f"p90 {row['p90_ms']:8.1f}  p99 {row['p99_ms']:8.1f}"
            )
    return 0 if summary["failed"] == 0 else 1
