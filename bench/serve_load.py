"""A burst of concurrent clients against `shiftlm serve --max-pending M` (issue 35): how many are
admitted, how fast the rest are refused (429 latency), the server's memory before and after, and how
long it takes to serve an ordinary request at its idle latency again. Writes bench/results/serve_load.json.

    python bench/serve_load.py --clients 3000 --max-pending 512           # the issue's scale
    python bench/serve_load.py --clients 1000 --max-pending 128 --json    # what a shared 2-core box allows

The server is the tiny random llama-gqa checkpoint (character tokenizer) on one rank (`--sp 2` for two),
started through the real command line (`serve/local_server.py`). Half the clients stream (SSE) and half
do not (`--stream-fraction`); every client sends one completion of `--max-tokens` tokens with
`ignore_eos`, all at once. A poller reads `shiftlm_num_requests_pending` from /metrics during the burst:
its maximum is the admitted count at any moment, which `--max-pending` must bound. Memory is the RSS
of the server and its worker ranks (/proc). Recovery: from the burst's last response to the first
8-token probe completion whose latency is within twice the idle one measured before the burst.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from shiftlm.serve.engine.tokenizer import write_char_tokenizer
from shiftlm.serve.local_server import local_server
from shiftlm.tools.tiny import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
NAME = "tiny"


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and its descendants."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return rss_kb * 1024 + sum(rss_bytes(int(child)) for child in children)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_client(http: httpx.AsyncClient, i: int, stream: bool, max_tokens: int) -> dict:
    body = {"model": NAME, "prompt": f"client {i} ", "max_tokens": max_tokens, "ignore_eos": True}
    started = time.perf_counter()
    try:
        if stream:
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                async for _ in response.aiter_lines():
                    pass
                status, retry = response.status_code, response.headers.get("retry-after")
        else:
            response = await http.post("/v1/completions", json=body)
            status, retry = response.status_code, response.headers.get("retry-after")
    except httpx.HTTPError as err:
        status, retry = f"transport: {type(err).__name__}", None
    return {
        "status": status,
        "seconds": time.perf_counter() - started,
        "retry_after": retry,
        "stream": stream,
    }


async def burst(url: str, clients: int, stream_fraction: float, max_tokens: int) -> list[dict]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        streaming = round(clients * stream_fraction)
        calls = [one_client(http, i, i < streaming, max_tokens) for i in range(clients)]
        return await asyncio.gather(*calls)


def probe_seconds(url: str) -> float:
    body = {"model": NAME, "prompt": "probe", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return time.perf_counter() - started


def pending(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return float(
        next(x for x in text.splitlines() if x.startswith("shiftlm_num_requests_pending ")).split()[-1]
    )


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint(Path(tmp) / NAME, "llama-gqa")
        write_char_tokenizer(model_dir, vocab_size=250)
        serve = [str(model_dir), "--served-model-name", NAME, "--log-interval", "0", "--disable-log-requests"]
        serve += ["--max-pending", str(args.max_pending), "--sp", str(args.sp), "--device", "cpu"]
        serve += ["--enforce-eager"]  # the startup compile has nothing to do with admission
        with local_server(serve, timeout=900, log_path=str(Path(tmp) / "serve.log")) as server:
            idle = statistics.median(probe_seconds(server.url) for _ in range(5))
            rss_before = rss_bytes(server.pid)
            seen: list[float] = []
            stop = threading.Event()

            def poll() -> None:
                while not stop.is_set():
                    try:
                        seen.append(pending(server.url))
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.05)

            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
            started = time.perf_counter()
            results = asyncio.run(burst(server.url, args.clients, args.stream_fraction, args.max_tokens))
            burst_s = time.perf_counter() - started
            stop.set()
            poller.join(timeout=30)
            ended = time.perf_counter()
            probes = []
            while True:
                seconds = probe_seconds(server.url)
                probes.append(seconds)
                if seconds <= 2 * idle or time.perf_counter() - ended > 120:
                    break
            recovery_s = time.perf_counter() - ended
            rss_after = rss_bytes(server.pid)
            health = httpx.get(f"{server.url}/health", timeout=30).status_code
    refused = [r for r in results if r["status"] == 429]
    ok = [r for r in results if r["status"] == 200]
    other = sorted({str(r["status"]) for r in results} - {"200", "429"})
    return {
        "command": "python bench/serve_load.py " + " ".join(args.argv),
        "clients": args.clients,
        "streaming_clients": sum(r["stream"] for r in results),
        "max_pending": args.max_pending,
        "max_tokens": args.max_tokens,
        "ranks": args.sp,
        "admitted": len(ok),
        "refused_429": len(refused),
        "other_statuses": other,
        "every_429_has_retry_after": all(r["retry_after"] for r in refused),
        "max_pending_seen": max(seen, default=None),
        "pending_samples": len(seen),
        "latency_429_p50_s": percentile([r["seconds"] for r in refused], 0.5),
        "latency_429_p99_s": percentile([r["seconds"] for r in refused], 0.99),
        "latency_200_p50_s": percentile([r["seconds"] for r in ok], 0.5),
        "burst_s": burst_s,
        "idle_probe_s": idle,
        "recovery_s": recovery_s,
        "recovery_probes": len(probes),
        "rss_before_mb": rss_before / 2**20,
        "rss_after_mb": rss_after / 2**20,
        "health_after": health,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=3000, help="concurrent clients in the burst")
    parser.add_argument("--max-pending", type=int, default=512, help="the server's --max-pending")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens each client asks for")
    parser.add_argument("--stream-fraction", type=float, default=0.5, help="share of streaming clients")
    parser.add_argument("--sp", type=int, default=1, help="server ranks (--sp; tp stays 1)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_load.json"))
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    import sys

    args = parser.parse_args()
    args.argv = sys.argv[1:]
    result = run(args)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>28}: {value}")


if __name__ == "__main__":
    main()
