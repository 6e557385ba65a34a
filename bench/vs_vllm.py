"""shiftlm against vLLM's CPU build on this machine: same checkpoint, same cores, same OpenAI client load.

    python bench/vs_vllm.py                                   # vLLM from /work/venv-vllm if it is there
    python bench/vs_vllm.py --vllm-python /path/to/venv/bin/python --rounds 3 --json
    python bench/vs_vllm.py --vllm-python none                # shiftlm alone, against HF `generate`

The checkpoint is a random-weight Llama written with `transformers` (hidden 512, 4 layers, 8 heads /
2 KV heads, FFN 1408, vocab 8000, fp32) with a character tokenizer. Every server is pinned with
`taskset` (1-rank servers and vLLM, API process included, on `--cores` cores; a 2-rank server gets
two cores and pins rank r to the r-th itself, `shiftlm serve --cpu-bind auto`, rank 0 with its HTTP
thread) and runs one compute thread per rank; the client runs on the remaining core. On a 2-core
machine there is no core left for the client of a 2-rank server: it shares rank 1's core, and the
client's own CPU per output token is recorded (`client_cpu_ms_per_token`) to show what it took. The load
(`openai.AsyncOpenAI`, streaming /v1/completions, `--prompt-len` random token ids, `--output-len`
tokens with ignore_eos, greedy): one request at a time, `--concurrency` at a time (closed loop), and a
short Poisson sweep (open loop). Rounds interleave: every round runs each load on each server in turn,
the order rotating, with fresh prompts (no prefix-cache hits), so machine noise falls on all servers
alike; the tables give medians over rounds and ratios within this run. Before each run every server
must be idle (under 5% of a core over 0.25 s; `settle_s` records the wait): vLLM keeps its core busy
for ~1 s after its last request, which made the server run after it on that core up to 20% slower. The machine is shared: the
result records the load average before and after. Writes bench/results/vs_vllm.json and .png.

A second part times the engine's decode step in-process (`--step-sweep`): at fixed context, step time
against the number of sequences, and at fixed batch, against the context, to check that it follows the
work (roofline) and not the number of sequences.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VLLM = Path("/work/venv-vllm/bin/python")
LAYOUTS = {  # name -> shiftlm serve arguments
    "tp1": ["--tp", "1", "--sp", "1", "--mode", "tp"],
    "tp1-eager": ["--tp", "1", "--sp", "1", "--mode", "tp", "--enforce-eager"],  # no compiled decode step
    "tp1-sp2-shift": ["--tp", "1", "--sp", "2", "--mode", "shift"],
    "tp2": ["--tp", "2", "--sp", "1", "--mode", "tp"],
}


def make_checkpoint(path: Path) -> Path:
    import torch
    import transformers as tf

    from shiftlm.serve.engine.tokenizer import write_char_tokenizer

    config = tf.LlamaConfig(
        vocab_size=8000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).float().save_pretrained(path, safe_serialization=True)
    write_char_tokenizer(path, vocab_size=8000)
    return path


def cpu_sets(cores: int) -> tuple[str, str, str]:
    """(1-rank server cores, 2-rank server cores, client cores) on this machine."""
    available = sorted(os.sched_getaffinity(0))
    single = available[:cores]
    double = available[: max(2, cores)]
    rest = [c for c in available if c not in single] or available[-1:]
    fmt = lambda cs: ",".join(map(str, cs))  # noqa: E731
    return fmt(single), fmt(double), fmt(rest)


class Server:
    """A server process started the way users start it, pinned with taskset; `url` once healthy."""

    def __init__(self, name: str, command: list[str], cores: str, env: dict, log: Path):
        self.name, self.log = name, log
        self.proc = subprocess.Popen(
            ["taskset", "-c", cores, *command],
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
        self.url = ""

    def wait(self, url: str | None, timeout: float) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()  # its other processes (vLLM's engine core) go too
                tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log tail:\n{tail}")
            if url is None:
                match = re.search(r" on (http://[\d.]+:\d+) ", self.log.read_text(errors="replace"))
                url = match.group(1) if match else None
            if url is not None:
                with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        self.url = url
                        return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} was not healthy within {timeout:.0f}s (log: {self.log})")

    def cpu_seconds(self) -> float:
        """CPU seconds (user + system, all threads) of the live processes of this server's session
        (it was started with start_new_session, so its process group id is its pid)."""
        total = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # a process that exited meanwhile
            if int(fields[2]) == self.proc.pid:  # field 5, pgrp
                total += int(fields[11]) + int(fields[12])  # fields 14, 15: utime, stime (ticks)
        return total / os.sysconf("SC_CLK_TCK")

    def wait_idle(self, window: float = 0.25, share: float = 0.05, timeout: float = 20.0) -> float:
        """Wait until this server uses under `share` of a core over `window` seconds; the seconds waited.
        vLLM's CPU build keeps a core busy for ~1 s after its last request (measured: 80-99% of its core
        in the first second, 0-1% after); a server run next on that core would pay for it."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            before, begun = self.cpu_seconds(), time.monotonic()
            time.sleep(window)
            if (self.cpu_seconds() - before) / (time.monotonic() - begun) < share:
                break
        return time.monotonic() - started - window

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_shiftlm(name: str, model: Path, args: argparse.Namespace, cores: str, log_dir: Path) -> Server:
    command = [sys.executable, "-m", "shiftlm.cli", "serve", "--model", str(model), *LAYOUTS[name]]
    command += ["--port", "0", "--model-name", "m", "--num-blocks", "1024", "--block-size", "16"]
    command += [
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-tokens-per-step",
        str(args.max_batched_tokens),
    ]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    server = Server(name, command, cores, env, log_dir / f"{name}.log")
    server.wait(None, timeout=300)
    return server


def start_vllm(python: str, model: Path, args: argparse.Namespace, cores: str, log_dir: Path) -> Server:
    import socket

    with socket.socket() as sock:  # vLLM takes a port number; pick a free one
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    command += ["--served-model-name", "m", "--dtype", "float32", "--port", str(port), "--host", "127.0.0.1"]
    command += ["--max-model-len", "2048", "--max-num-seqs", str(args.max_num_seqs)]
    command += ["--max-num-batched-tokens", str(args.max_batched_tokens), "--disable-log-stats"]
    threads = str(len(cores.split(",")))
    env = {"VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": threads}
    server = Server("vllm", command, cores, env, log_dir / "vllm.log")
    server.wait(f"http://127.0.0.1:{port}", timeout=args.vllm_start_timeout)
    return server


async def one_request(client, prompt: list[int], output_len: int, sent_at: float | None = None) -> dict:
    start = time.perf_counter() if sent_at is None else sent_at
    first = last = None
    tokens = 0
    stream = await client.completions.create(
        model="m",
        prompt=prompt,
        max_tokens=output_len,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text is not None:
            first = now if first is None else first
            last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    ttft = first - start
    return {"ttft": ttft, "e2e": last - start, "tokens": tokens, "tpot": (last - first) / max(tokens - 1, 1)}


async def run_load(url: str, prompts: list[list[int]], output_len: int, concurrency: int, rate: float):
    """Closed loop with `concurrency` clients (rate 0), or Poisson arrivals at `rate` requests/s."""
    import httpx
    import openai

    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=256), timeout=600)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", http_client=http, max_retries=0)
    results: list[dict] = []
    started, client_cpu = time.perf_counter(), time.process_time()
    if rate > 0:
        gaps = random.Random(len(prompts)).expovariate
        arrival, tasks = 0.0, []
        for prompt in prompts:
            await asyncio.sleep(max(0.0, started + arrival - time.perf_counter()))
            tasks.append(asyncio.create_task(one_request(client, prompt, output_len, started + arrival)))
            arrival += gaps(rate)
        results = list(await asyncio.gather(*tasks))
    else:
        queue = list(prompts)

        async def worker():
            while queue:
                results.append(await one_request(client, queue.pop(), output_len))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    duration = time.perf_counter() - started
    client_cpu = time.process_time() - client_cpu
    await http.aclose()
    tokens = sum(r["tokens"] for r in results)
    return {
        "client_cpu_ms_per_token": 1e3 * client_cpu / max(tokens, 1),
        "requests": len(results),
        "out_tok_s": tokens / duration,
        "tpot_ms": 1e3 * statistics.fmean(r["tpot"] for r in results),
        "ttft_ms": 1e3 * statistics.fmean(r["ttft"] for r in results),
        "ttft_p90_ms": 1e3 * sorted(r["ttft"] for r in results)[int(0.9 * (len(results) - 1))],
        "tokens_ok": all(r["tokens"] == results[0]["tokens"] for r in results),
        "duration_s": duration,
    }


def hf_generate_baseline(model: Path, args: argparse.Namespace) -> dict:
    """HF `generate` on one thread: one request at a time, and `concurrency` prompts as one batch."""
    import torch
    import transformers

    torch.set_num_threads(1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    rng = random.Random(1)
    out = {}
    for label, batch in (("1 at a time", 1), (f"{args.concurrency} concurrent", args.concurrency)):
        ids = torch.tensor([[rng.randrange(3, 8000) for _ in range(args.prompt_len)] for _ in range(batch)])
        started = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False)
        seconds = time.perf_counter() - started
        out[label] = {
            "out_tok_s": batch * args.output_len / seconds,
            "tpot_ms": 1e3 * seconds / args.output_len,
        }
    return out


def step_sweep(model: Path, contexts: list[int], batches: list[int]) -> list[dict]:
    """In-process step time (one thread, min CPU time of 15) by number of decode sequences, by context
    length, and for one sequence with as many new tokens as the largest decode batch."""
    import torch

    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan
    from shiftlm.serve.worker.runner import ModelRunner

    torch.set_num_threads(1)
    runner = ModelRunner.load(model, Mesh(ParallelConfig()), num_blocks=8192, block_size=16)
    rows = []
    cases = [(s, 1, contexts[0]) for s in batches] + [(batches[-1], 1, c) for c in contexts[1:]]
    cases.append((1, batches[-1], contexts[0]))  # one sequence, as many tokens as the largest batch
    for seqs, tokens, context in cases:
        blocks = (context + tokens) // 16 + 1
        chunks = tuple(
            ScheduledChunk(i, (5,) * tokens, context, tuple(range(i * blocks, (i + 1) * blocks)), True, row=i)
            for i in range(seqs)
        )
        plan = StepPlan(0, Mode.TP, chunks)
        for _ in range(3):
            runner.execute(plan)
        cpu, wall = [], []
        for _ in range(15):
            c, w = time.thread_time(), time.perf_counter()
            runner.execute(plan)
            cpu.append(time.thread_time() - c)
            wall.append(time.perf_counter() - w)
        rows.append(
            {
                "seqs": seqs,
                "tokens_per_seq": tokens,
                "context": context,
                "cpu_ms": 1e3 * min(cpu),
                "wall_ms": 1e3 * statistics.median(wall),
            }
        )
        print(
            f"  step: {seqs:3d} seqs x {tokens:3d} new tokens after {context:4d}  cpu {rows[-1]['cpu_ms']:7.2f} ms",
            flush=True,
        )
    return rows


def loads(args: argparse.Namespace) -> list[tuple[str, int, float, int]]:
    """(label, concurrency, Poisson rate, requests) of every load of a round."""
    out = [("1 at a time", 1, 0.0, args.serial_requests)]
    count = args.concurrent_requests or 2 * args.concurrency
    out.append((f"{args.concurrency} concurrent", args.concurrency, 0.0, count))
    out += [(f"poisson {rate:g}/s", 0, rate, args.poisson_requests) for rate in args.rates]
    return out


def summarize(rows: list[dict], servers: list[str], reference: str | None) -> list[dict]:
    table = []
    for label in dict.fromkeys(r["load"] for r in rows):
        for name in servers:
            runs = [r for r in rows if r["load"] == label and r["server"] == name]
            if not runs:
                continue
            entry = {"load": label, "server": name, "rounds": len(runs)}
            for key in ("out_tok_s", "tpot_ms", "ttft_ms", "ttft_p90_ms", "client_cpu_ms_per_token"):
                entry[key] = statistics.median(r[key] for r in runs)
            table.append(entry)
    if reference is not None:
        for entry in table:
            ref = next(e for e in table if e["load"] == entry["load"] and e["server"] == reference)
            entry["vs"] = reference
            entry.update({f"{k}_ratio": entry[k] / ref[k] for k in ("out_tok_s", "tpot_ms", "ttft_ms")})
    return table


def plot(table: list[dict], servers: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(e["load"] for e in table))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    width = 0.8 / len(servers)
    for i, name in enumerate(servers):
        for ax, key, title in zip(
            axes,
            ("out_tok_s", "tpot_ms", "ttft_ms"),
            ("output tokens/s (higher is better)", "mean TPOT ms (lower is better)", "mean TTFT ms"),
        ):
            values = [
                next((e[key] for e in table if e["load"] == lb and e["server"] == name), 0) for lb in labels
            ]
            ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
            ax.set(title=title, xticks=[x + 0.4 - width / 2 for x in range(len(labels))])
            ax.set_xticklabels(labels, rotation=20, fontsize=8)
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def find_vllm(flag: str | None) -> str | None:
    if flag is not None:
        return None if flag == "none" else flag
    if DEFAULT_VLLM.exists():
        return str(DEFAULT_VLLM)
    probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True)
    return sys.executable if probe.returncode == 0 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=None, help="python with vLLM installed; 'none' skips vLLM")
    parser.add_argument("--layouts", default="tp1,tp1-sp2-shift,tp2", help=f"of {', '.join(LAYOUTS)}")
    parser.add_argument("--cores", type=int, default=1, help="compute cores of a 1-rank server (and vLLM)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (server order rotates)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--serial-requests", type=int, default=4, help="requests of the 1-at-a-time load")
    parser.add_argument(
        "--concurrent-requests",
        type=int,
        default=0,
        help="requests of the concurrent load (default 2 x --concurrency; more average over the "
        "closed loop's staggered and wave regimes, docs/serving.md)",
    )
    parser.add_argument(
        "--rates", type=float, nargs="*", default=[4.0, 8.0, 16.0], help="Poisson sweep, req/s"
    )
    parser.add_argument("--poisson-requests", type=int, default=32)
    parser.add_argument(
        "--client-cores",
        choices=("rest", "any"),
        default="rest",
        help="rest: the client on the cores no 1-rank server uses (on 2 cores: rank 1's core of a 2-rank "
        "server); any: every core, placed by the kernel",
    )
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-batched-tokens", type=int, default=512, help="token budget of one step (both)")
    parser.add_argument("--vllm-start-timeout", type=float, default=900.0)
    parser.add_argument("--step-sweep", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--only-step-sweep", action="store_true", help="time decode steps only (no servers)")
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="write (or reuse) the checkpoint here; vLLM's compile cache then hits",
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    args = parser.parse_args()
    layouts = [name for name in args.layouts.split(",") if name]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout(s) {unknown}; choose from {', '.join(LAYOUTS)}")
    if shutil.which("taskset") is None:
        parser.error("taskset (util-linux) is needed to pin the servers to cores")
    if args.only_step_sweep:
        with tempfile.TemporaryDirectory() as tmp:
            model = Path(args.checkpoint_dir or Path(tmp) / "llama-h512")
            if not (model / "config.json").exists():
                make_checkpoint(model)
            sweep = step_sweep(model, [160, 64, 512, 1024], [1, 8, 32, 64])
        path = Path(args.out) / "vs_vllm_step_sweep.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"loadavg": os.getloadavg(), "decode_step_sweep": sweep}, indent=1))
        print(json.dumps(sweep) if args.json else f"wrote {path}")
        return 0
    vllm_python = find_vllm(args.vllm_python)
    single, double, client_cores = cpu_sets(args.cores)
    if args.client_cores == "any":  # the kernel places the client (beside whichever server core is free)
        client_cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    elif any(name in ("tp1-sp2-shift", "tp2") for name in layouts) and set(client_cores.split(",")) & set(
        double.split(",")
    ):  # too few cores: the client shares a core with the 2-rank servers alone (docs/serving.md)
        print(
            f"note: the client runs on core(s) {client_cores}, which the 2-rank servers use and the "
            "1-rank servers and vLLM do not; --client-cores any places it alike for every server"
        )
    os.sched_setaffinity(0, {int(c) for c in client_cores.split(",")})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    rows, servers, server_notes = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model = Path(args.checkpoint_dir or Path(tmp) / "llama-h512")
        if not (model / "config.json").exists():
            make_checkpoint(model)
        if vllm_python:
            print(f"starting vLLM ({vllm_python}) on cores {single} ...", flush=True)
            servers["vllm"] = start_vllm(vllm_python, model, args, single, Path(tmp))
            stack.callback(servers["vllm"].stop)
        for name in layouts:
            cores = single if name.startswith("tp1") and "sp2" not in name else double
            servers[name] = start_shiftlm(name, model, args, cores, Path(tmp))
            startup = servers[name].log.read_text(errors="replace")
            found = re.search(r"threshold=(\d+)", startup)  # a shift server's (measured) threshold
            probe = re.search(r"shift threshold auto: (.*)", startup)
            server_notes[name] = {
                "shift_threshold": int(found.group(1)) if found else None,
                "threshold_probe": probe.group(1).strip() if probe else None,
            }
            stack.callback(servers[name].stop)
        names = list(servers)
        rng = random.Random(0)

        def prompts(count: int) -> list[list[int]]:
            return [[rng.randrange(3, 8000) for _ in range(args.prompt_len)] for _ in range(count)]

        for name in names:  # warm-up, discarded
            asyncio.run(run_load(servers[name].url, prompts(4), 8, 4, 0.0))
        for round_index in range(args.rounds):
            for label, concurrency, rate, count in loads(args):
                batch = prompts(count)  # the same prompts for every server in this cell
                order = names[round_index % len(names) :] + names[: round_index % len(names)]
                for name in order:
                    # every server idle first: no run pays for the previous server's after-load work
                    settle = max(servers[other].wait_idle() for other in names)
                    # each server sees these prompts once; other cells use fresh ones (no prefix hits)
                    result = asyncio.run(
                        run_load(servers[name].url, batch, args.output_len, concurrency, rate)
                    )
                    result["settle_s"] = round(settle, 2)
                    rows.append({"round": round_index, "load": label, "server": name, **result})
                    print(
                        f"round {round_index} {label:14s} {name:15s} {result['out_tok_s']:7.1f} tok/s  "
                        f"TPOT {result['tpot_ms']:6.1f} ms  TTFT {result['ttft_ms']:7.1f} ms  "
                        f"client {result['client_cpu_ms_per_token']:.2f} ms CPU/token",
                        flush=True,
                    )
        baseline = None if vllm_python else hf_generate_baseline(model, args)
        stack.close()
        sweep = step_sweep(model, [160, 64, 512, 1024], [1, 8, 32, 64]) if args.step_sweep else []
    reference = "vllm" if vllm_python else None
    table = summarize(rows, names, reference)
    result = {
        "args": vars(args),
        "cores": {
            "1-rank servers and vLLM": single,
            "2-rank servers (rank r on the r-th core)": double,
            "client": client_cores,
        },
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "servers": server_notes,
        "summary": table,
        "hf_generate": baseline,
        "decode_step_sweep": sweep,
        "runs": rows,
    }
    (out / "vs_vllm.json").write_text(json.dumps(result, indent=1))
    plot(table, names, out / "vs_vllm.png")
    if args.json:
        print(json.dumps({k: result[k] for k in ("cores", "loadavg_before", "loadavg_after", "summary")}))
    else:
        print(f"\nmedian of {args.rounds} rounds; load average before {load_before}, after {os.getloadavg()}")
        print(
            "load            server           out tok/s    TPOT ms    TTFT ms"
            + (f"   ratios vs {reference}" if reference else "")
        )
        for e in table:
            ratios = (
                f"  tok/s x{e['out_tok_s_ratio']:.2f}  TPOT x{e['tpot_ms_ratio']:.2f}  TTFT x{e['ttft_ms_ratio']:.2f}"
                if reference
                else ""
            )
            print(
                f"{e['load']:15s} {e['server']:15s} {e['out_tok_s']:9.1f} {e['tpot_ms']:10.2f} {e['ttft_ms']:10.1f}{ratios}"
            )
        if baseline:
            for label, value in baseline.items():
                print(f"HF generate {label}: {value['out_tok_s']:.1f} tok/s, TPOT {value['tpot_ms']:.2f} ms")
        print(f"wrote {out / 'vs_vllm.json'} and {out / 'vs_vllm.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
