"""Serving on one GPU against transformers and the hardware (issue 34), one JSON + PNG per phase in
bench/results/gpu/, the device named in each.

    python bench/gpu_serve.py --out bench/results/gpu                  # every phase, each its own process
    python bench/gpu_serve.py --phase decode --out DIR                 # one phase
    python bench/gpu_serve.py --smoke --out /tmp/gs                    # the CPU, tiny shapes: checks the script
    python bench/gpu_serve.py --quick --phase decode --phase offline   # issue 34's must-show points only

Phases (each a subprocess with its own time limit, so one failure leaves the others' results):
- decode: the engine's decode step (ModelRunner, the ~1.1B Llama of bench/gpu.py in bf16), eager and
  compiled (`--enforce-eager` off: worker/compiled_step.py), at batch 1..128 and context 512 / 2048, against transformers with a static cache under
  `torch.compile(mode="reduce-overhead")` (CUDA graphs) on the same weights, and the HBM roofline
  (weights + the K/V the step reads, over a measured device-to-device copy rate).
- offline: 256 requests, prompts of 128-512 random tokens, 128 greedy tokens each (EOS ignored):
  `shiftlm.LLM.generate` against transformers' continuous batching (`generate_batch`), output tok/s.
- server: `shiftlm serve` replaying the Azure conversation trace (`shiftlm bench serve`) at rising
  request rates: TTFT / TPOT p50 and p90 per rate, and the highest rate held with TPOT p90 <= 50 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from gpu import phase_limits, run_group  # noqa: E402 - bench/gpu.py, found through the path above

PHASES = phase_limits({"decode": 420, "offline": 300, "server": 240})  # seconds each
SMOKE = os.environ.get("SHIFTLM_GPU_SMOKE") == "1"  # bench/gpu.py's switch: its small shapes, on the CPU
# --quick: the decode phase at only what issue 34 must show (1 and 64 sequences at context 512), for a
# GPU session with minutes to spend
QUICK = os.environ.get("SHIFTLM_GPU_QUICK") == "1"


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _model_dir() -> Path:
    """The ~1.1B Llama of bench/gpu.py (its small shape under --smoke), with a tokenizer."""
    import gpu  # bench/: reads SHIFTLM_GPU_SMOKE when imported

    return gpu.checkpoint(gpu.work_dir() / ("gs-smoke" if SMOKE else "gs-1b"), gpu.MODEL_1B)


def _timed(fn, reps: int) -> float:
    """Median seconds of `fn` after two warm-up calls, the device synchronised around each."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _copy_rate(device) -> float:
    """Bytes/s of a device-to-device copy of 1 GiB (256 MiB on the CPU): the memory's practical rate."""
    import torch

    n = (2**28 if device.type == "cpu" else 2**30) // 4
    src, dst = torch.empty(n, device=device), torch.empty(n, device=device)
    seconds = _timed(lambda: dst.copy_(src), 5)
    return 2 * n * 4 / seconds  # read + write


def phase_decode(out: Path) -> dict:
    import torch

    from shiftlm.config import ModelConfig

    model_dir = _model_dir()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = ModelConfig.from_hf(model_dir)
    contexts = (32, 64) if SMOKE else (512,) if QUICK else (512, 2048)
    batches = (1, 2, 4) if SMOKE else (1, 64) if QUICK else (1, 2, 4, 8, 16, 32, 64, 128)
    rows: dict = {}
    meta: dict = {}  # the copy rate and weight bytes the roofline used
    errors: dict[str, str] = {}
    phase_start = time.perf_counter()
    # transformers compiled first (the must-show's baseline), then the compiled step (worker/
    # compiled_step.py: on CUDA every decode batch, from CUDA graphs) over gather + SDPA attention, the
    # compiled one over FlexAttention reading the blocks in place (worker/flex_decode.py, issue 34's
    # candidate), and the eager step last, each on a runner of its own (its load time includes the
    # compiles and captures); every row lands in the partial file as it is measured, so a phase
    # killed at its limit keeps the comparison; a variant that fails is reported, not fatal, and one
    # is left out once the phase's time is half (FlexAttention) or three quarters (eager) spent
    try:
        times = iter(_transformers_decode(model_dir, device, dtype, contexts, batches))
        for context in contexts:
            for batch in batches:
                row = rows.setdefault((context, batch), dict(context=context, batch=batch))
                row["transformers_compiled_ms"] = next(times) * 1e3
        _write_partial(out, rows, meta, dtype)
    except Exception as err:  # noqa: BLE001 - the baseline's failure must not lose ours
        errors["transformers_compiled"] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
    for name, compiled, backend, share in (
        ("shiftlm_compiled", True, "auto", 1.0),
        ("shiftlm_compiled_flex", True, "flex", 0.5),
        ("shiftlm", False, "auto", 0.75),
    ):
        if time.perf_counter() - phase_start > PHASES["decode"] * share:
            errors[name] = f"skipped: {share:.0%} of the phase's time was spent"
            continue
        try:
            _decode_variant(
                rows, meta, name, compiled, backend, model_dir, device, dtype, config, contexts, batches, out
            )
        except Exception as err:  # noqa: BLE001 - one variant's failure must not lose the others' numbers
            errors[name] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
            print(json.dumps({"variant": name, "error": errors[name]}), flush=True)
    rows = list(rows.values())
    for row in rows:
        hf = row.get("transformers_compiled_ms")
        for name in ("shiftlm", "shiftlm_compiled", "shiftlm_compiled_flex"):
            if hf and f"{name}_ms" in row:
                ratio = (
                    "vs_transformers" if name == "shiftlm" else f"{name[len('shiftlm_') :]}_vs_transformers"
                )
                row[ratio] = hf / row[f"{name}_ms"]
    result = dict(device=device_name(), dtype=str(dtype), **meta, rows=rows, errors=errors)
    _plot_decode(rows, out / "gpu_serve_decode.png", result["device"])
    return result


def _decode_variant(
    rows, meta, name, compiled, backend, model_dir, device, dtype, config, contexts, batches, out
) -> None:
    """One runner's decode step times, into `rows` (keyed by context and batch) as `{name}_ms`; every
    row also lands in OUT/gpu_serve_decode.partial.json at once (a phase killed at its limit keeps it)."""
    import torch

    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan
    from shiftlm.serve.worker.runner import ModelRunner

    block = 16
    blocks_per_seq = max(contexts) // block + 1
    start = time.perf_counter()
    runner = ModelRunner.load(
        model_dir,
        Mesh(ParallelConfig(), device=device),
        max(batches) * blocks_per_seq,
        block,
        dtype=dtype,
        compile_decode=compiled,  # on CUDA: CUDA graphs for these batches and contexts too
        attention_backend=backend,
        max_num_seqs=max(batches),
        cuda_graph_sizes=tuple(batches),  # captures only the measured batches (--quick: 2 sizes, not 11)
        max_model_len=max(contexts) + block,
    )
    load_s = time.perf_counter() - start
    rate = _copy_rate(device)
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.shift_model.model.parameters())
    meta.update(copy_gbps=rate / 1e9, weight_bytes=weight_bytes)
    kv_per_token = (
        2 * config.num_layers * config.num_kv_heads * config.head_dim * torch.finfo(dtype).bits // 8
    )
    for context in contexts:
        for batch in batches:
            # prefill `batch` sequences of `context - 1` tokens, then time decode steps at `context`
            random.seed(context * 1000 + batch)
            chunks = []
            for s in range(batch):
                blocks = tuple(range(s * blocks_per_seq, (s + 1) * blocks_per_seq))
                ids = tuple(random.randrange(config.vocab_size) for _ in range(context - 1))
                chunks.append(ScheduledChunk(s, ids, 0, blocks, True, row=s))
            for chunk in chunks:
                runner.run_step(StepPlan(0, Mode.TP, (chunk,)))
            decode = StepPlan(
                1,
                Mode.TP,
                tuple(ScheduledChunk(s, (7,), context - 1, (), True, row=s) for s in range(batch)),
            )
            compiled_steps = _fast_steps(runner)
            ours = _timed(lambda plan=decode, runner=runner: runner.run_step(plan), 5 if SMOKE else 20)
            roofline = (weight_bytes + batch * context * kv_per_token) / rate
            row = rows.setdefault((context, batch), dict(context=context, batch=batch))
            row["roofline_ms"] = roofline * 1e3
            row[f"{name}_ms"] = ours * 1e3
            row[f"{name}_load_s"] = load_s
            row[f"{name}_ran_compiled"] = _fast_steps(runner) > compiled_steps
            if batch == max(batches) and context == contexts[0]:  # host- or kernel-bound, and why
                row[f"{name}_profile"] = _profile_step(lambda plan=decode: runner.run_step(plan))
            print(json.dumps(row), flush=True)
            _write_partial(out, rows, meta, dtype)


def _write_partial(out: Path, rows: dict, meta: dict, dtype) -> None:
    """The decode rows measured so far (a phase killed at its limit keeps them)."""
    partial = dict(device=device_name(), dtype=str(dtype), **meta, rows=list(rows.values()))
    (out / "gpu_serve_decode.partial.json").write_text(json.dumps(partial, indent=2) + "\n")


def _profile_step(step, reps: int = 5) -> dict:
    """One decode step under the profiler: the device's kernel time against the step's wall time (a
    host-bound step shows a busy fraction well under 1), kernels launched, and the host's costliest ops."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    step()
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()  # inside: the profiler's own start-up is no step's time
        for _ in range(reps):
            step()
        if cuda:
            torch.cuda.synchronize()
        wall_ms = 1e3 * (time.perf_counter() - start) / reps
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy_ms = sum(e.device_time for e in kernels) / 1e3 / reps if kernels else None
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    return {
        "wall_ms_profiled": wall_ms,
        "gpu_busy_ms": busy_ms,
        "gpu_busy_fraction": busy_ms / wall_ms if busy_ms else None,
        "kernels_per_step": len(kernels) / reps,
        "top_self_cpu_ops": [
            {"op": e.key[:80], "per_step": e.count / reps, "self_cpu_ms": e.self_cpu_time_total / 1e3 / reps}
            for e in top
        ],
    }


def _fast_steps(runner) -> int:
    """Steps the runner took compiled or replayed from a CUDA graph (a replay counts as the graphs'
    step only, not the compiled step's)."""
    model = runner.shift_model
    return sum(part.steps for part in (model.compiled, model.graphs) if part is not None)


def _transformers_decode(model_dir: Path, device, dtype, contexts, batches) -> list[float]:
    """Seconds per decode step of transformers with a static cache, compiled (CUDA graphs on a GPU)."""
    import torch
    from transformers import AutoModelForCausalLM, StaticCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    forward = torch.compile(
        model.forward, mode="reduce-overhead" if device.type == "cuda" else "default", dynamic=False
    )
    times = []
    for context in contexts:
        for batch in batches:
            cache = StaticCache(config=model.config, max_cache_len=context + 8)
            ids = torch.randint(0, model.config.vocab_size, (batch, context - 1), device=device)
            with torch.no_grad():
                model(ids, past_key_values=cache, use_cache=True)
                token = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
                position = torch.tensor([context - 1], device=device)
                times.append(
                    _timed(
                        lambda t=token, c=cache, p=position: forward(t, past_key_values=c, cache_position=p),
                        5 if SMOKE else 20,
                    )
                )
    return times


def _plot_decode(rows: list[dict], path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        mine = [r for r in rows if r["context"] == context]
        batches = [r["batch"] for r in mine]
        for key, label in (
            ("shiftlm_ms", "shiftlm eager"),
            ("shiftlm_compiled_ms", "shiftlm compiled (gather + SDPA)"),
            ("shiftlm_compiled_flex_ms", "shiftlm compiled (FlexAttention)"),
            ("transformers_compiled_ms", "transformers compiled"),
            ("roofline_ms", "HBM roofline"),
        ):
            ax.plot(batches, [r.get(key, float("nan")) for r in mine], marker="o", label=label)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="sequences",
            ylabel="ms per decode step",
            title=f"context {context}, {device}",
        )
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def phase_offline(out: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from shiftlm import LLM, SamplingParams

    model_dir = _model_dir()
    requests, new_tokens = (8, 8) if SMOKE else (256, 128)
    rng = random.Random(0)
    import gpu

    vocab = gpu.MODEL_1B["vocab_size"]
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(16, 64) if SMOKE else rng.randint(128, 512))]
        for _ in range(requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    seconds = {}
    with LLM(
        str(model_dir),
        max_num_seqs=64 if SMOKE else 256,
        max_tokens_per_step=512 if SMOKE else 8192,
        async_scheduling=True,
        # powers of two: 9 sizes x the context buckets, not vLLM's 35 (315 captures at startup)
        cuda_graph_sizes=(1, 2, 4, 8, 16, 32, 64) if SMOKE else (1, 2, 4, 8, 16, 32, 64, 128, 256),
    ) as llm:
        llm.generate(prompts[:2], params)  # warm-up (compiles)
        # both ways on one load (same weights, graphs and cache): the engine's switch, between batches
        for name, ahead in (("sync", False), ("async", True), ("sync2", False), ("async2", True)):
            llm._engine.async_scheduling = ahead
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            seconds[name] = time.perf_counter() - start
    ours = min(seconds["async"], seconds["async2"])
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    mine = dict(device=device_name(), requests=requests, shiftlm_tok_s=produced / ours)
    # kept if the phase is killed during transformers' run
    (out / "gpu_serve_offline.partial.json").write_text(json.dumps(mine | {"seconds": seconds}, indent=2))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.generate_batch(prompts[:2], generation_config=config)
    start = time.perf_counter()
    theirs = model.generate_batch(prompts, generation_config=config)
    hf_seconds = time.perf_counter() - start
    hf_tokens = sum(len(r.generated_tokens) for r in theirs.values())
    result = dict(
        **mine,
        shiftlm_sync_tok_s=produced / min(seconds["sync"], seconds["sync2"]),
        async_over_sync=min(seconds["sync"], seconds["sync2"]) / ours,
        transformers_generate_batch_tok_s=hf_tokens / hf_seconds,
    )
    result["vs_transformers"] = result["shiftlm_tok_s"] / result["transformers_generate_batch_tok_s"]
    return result


def phase_server(out: Path) -> dict:
    from shiftlm.serve.local_server import local_server

    model_dir = _model_dir()
    rates = (1.0, 2.0) if SMOKE else (2.0, 4.0, 8.0, 16.0, 32.0)
    rows = []
    with local_server(
        ["--model", str(model_dir), "--max-num-seqs", "128"], timeout=PHASES["server"]
    ) as server:
        for rate in rates:
            command = [sys.executable, "-m", "shiftlm.cli", "bench", "serve", "--trace", "azure_conv", "--url", server.url,
                       "--rate", str(rate), "--max-requests", "8" if SMOKE else "100", "--json"]  # fmt: skip
            if SMOKE:
                command += ["--max-input", "32", "--max-output", "8"]
            run = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if run.returncode != 0:
                rows.append(dict(rate=rate, error=run.stderr.strip().splitlines()[-1:]))
                continue
            summary = json.loads(run.stdout)
            rows.append(
                dict(
                    rate=rate,
                    completed=summary["completed"],
                    output_tok_s=summary["output_token_throughput"],
                    **{
                        f"{k}_{q}_ms": summary[k][f"{q}_ms"] for k in ("ttft", "tpot") for q in ("p50", "p90")
                    },
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    held = [r["rate"] for r in rows if r.get("completed") and r["tpot_p90_ms"] <= 50.0]
    return dict(
        device=device_name(),
        trace="azure_conv",
        rows=rows,
        highest_rate_tpot_p90_50ms=max(held, default=None),
    )


def run_phase(name: str, out: Path) -> int:
    started = time.perf_counter()
    try:
        result = globals()[f"phase_{name}"](out)
    except Exception as err:  # noqa: BLE001 - recorded, so the other phases still report
        import traceback

        result = dict(
            device=device_name(), error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()
        )
    result["phase_s"] = round(time.perf_counter() - started, 1)
    (out / f"gpu_serve_{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {k: v for k, v in result.items() if k in ("error", "phase_s", "device", "vs_transformers")}
        ),
        flush=True,
    )
    return 1 if "error" in result else 0


def main() -> int:
    global SMOKE
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--phase", action="append", choices=list(PHASES), help="run only these (repeatable)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu"))
    parser.add_argument(
        "--smoke", action="store_true", help="every phase on the CPU, tiny (checks the script)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="decode at the must-show points only (1 and 64 sequences @ 512)"
    )
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    SMOKE = SMOKE or args.smoke
    if SMOKE:
        os.environ["SHIFTLM_GPU_SMOKE"] = "1"  # the phases' processes inherit it
    if args.quick:
        os.environ["SHIFTLM_GPU_QUICK"] = "1"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    phases = args.phase or list(PHASES)
    if args.in_process:
        return max(run_phase(name, out) for name in phases)
    code = 0
    for name in phases:
        print(f"== {name} (limit {PHASES[name]} s)", flush=True)
        command = [sys.executable, __file__, "--in-process", "--phase", name, "--out", str(out)]
        returncode, _, _ = run_group(command, PHASES[name], capture=False)  # killed whole past its limit
        if returncode == "timeout":
            print(f"== {name}: over its {PHASES[name]} s limit", flush=True)
        code = max(code, 1 if returncode == "timeout" else returncode)
    return code


if __name__ == "__main__":
    sys.exit(main())
