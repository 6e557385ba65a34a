"""Training step A/B on one device: shiftlm eager and compiled against transformers eager and compiled.

    python bench/gpu_train.py                                # CUDA, the ~1.1B Llama at 4 x 2048, bf16
    python bench/gpu_train.py --device cpu --tiny            # a smoke test of this script on the CPU

Four variants, the same random weights (one checkpoint written by transformers), the same batches and
the same optimizer (AdamW, lr 3e-4 constant, betas 0.9 / 0.95, weight decay 0.1 on matrices only,
eps 1e-8, global-norm clip 1.0; bf16 autocast over fp32 weights and moments on CUDA, fp32 on the CPU):
- shiftlm_eager / shiftlm_compiled: `Trainer.step` of `shiftlm train` itself (its flat fp32 AdamW, the
  chunked LM head + loss), `train.compile` false / true;
- hf_eager / hf_compiled: `LlamaForCausalLM` (SDPA attention) + `torch.optim.AdamW(foreach=True)`,
  the loss on its logits, plain / `torch.compile(model)`.
Each variant runs in a process of its own (alone on the device: peak memory is its own), in rounds
whose order alternates (A B C D, then D C B A, ...) so drift in clocks or load spreads over all four;
the first round runs them in the order that matters most (shiftlm compiled, transformers compiled,
shiftlm eager, transformers eager) and --deadline bounds the whole run (a variant that would not fit
is not started, one that runs past it is killed), so a short GPU loan gets the first ones.
Per variant: the first step's time (compilation included), the median of the timed steps over all
rounds, tokens/s, MFU (the project's FLOPs per token, `ModelConfig.flops_per_token`, against the
catalog's bf16 peak of the device, `hardware.device_peak_flops`), peak memory (CUDA's allocator peak;
on the CPU the process's peak RSS) and the losses (the same first loss on all four: same weights
and batch). JSON into bench/results/gpu/gpu_train_<device>.json, rewritten after every variant's
process: a kill keeps what was measured before it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gpu import MODEL_1B, run_group  # TinyLlama-1.1B's shape, the one the GPU checks use
from gpu import checkpoint as write_checkpoint  # random weights, as every GPU check writes them

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("shiftlm_compiled", "hf_compiled", "shiftlm_eager", "hf_eager")  # most wanted first
# seconds a variant's process is assumed to need before it has run once (start, imports, the weights'
# load, a few steps): with less left of --deadline it is not started
MIN_VARIANT_S = 20.0
MODEL_TINY = dict(
    MODEL_1B,
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
LR, BETAS, WEIGHT_DECAY, EPS, CLIP = 3e-4, (0.9, 0.95), 0.1, 1e-8, 1.0


def batches(vocab: int, batch: int, seq: int, count: int):
    """`count` batches of (inputs, targets) numpy arrays [batch, seq], seeded: the same for every variant."""
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=(count, batch, seq + 1), dtype=np.int64)
    return [(t[:, :-1].copy(), t[:, 1:].copy()) for t in tokens]


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gib(device) -> float:
    import resource

    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def shiftlm_stepper(checkpoint: Path, device, compiled: bool, batch: int, seq: int, log_dir: str):
    from shiftlm.train.config import load_config
    from shiftlm.train.trainer import Trainer

    config = load_config(
        None,
        [
            f"--model.name={checkpoint}",
            f"--train.device={device.type}",
            f"--train.compile={str(compiled).lower()}",
            f"--train.micro_batch={batch}",
            f"--train.global_batch={batch}",
            f"--train.seq_len={seq}",
            "--train.steps=1000000",
            f"--optim.lr={LR}",
            f"--optim.min_lr={LR}",
            "--optim.warmup_steps=0",
            f"--optim.beta1={BETAS[0]}",
            f"--optim.beta2={BETAS[1]}",
            f"--optim.weight_decay={WEIGHT_DECAY}",
            f"--optim.eps={EPS}",
            f"--optim.grad_clip={CLIP}",
            f"--log.dir={log_dir}",
            "--log.progress=off",
            "--checkpoint.resume=false",
            "--monitor.watchdog_s=0",
            "--monitor.straggler_every=0",
        ],
    )
    trainer = Trainer(config, quiet=True)
    count = iter(range(10**9))
    return lambda data: trainer.step(next(count), [data])[0]


def hf_stepper(checkpoint: Path, device, compiled: bool):
    import torch
    import torch.nn.functional as F
    import transformers as tf

    tf.logging.set_verbosity_error()
    model = tf.AutoModelForCausalLM.from_pretrained(
        checkpoint, torch_dtype=torch.float32, attn_implementation="sdpa"
    )
    model = model.to(device).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": other, "weight_decay": 0.0}],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        foreach=True,
    )
    forward = torch.compile(model) if compiled else model
    autocast = device.type == "cuda"

    def step(data) -> float:
        ids, targets = (torch.as_tensor(a, device=device) for a in data)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = forward(input_ids=ids).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        optimizer.step()
        return loss.item()

    return step


def run_variant(args: argparse.Namespace) -> dict:
    """One variant in this process: `--warmup` untimed steps (the first timed apart: compilation), then
    `--steps` timed ones; each on the next of the shared batches."""
    import torch

    device = torch.device(args.device)
    if device.type == "cuda":  # set_device refuses a device without an index ("cuda")
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    name = args.variant
    vocab = json.loads((args.checkpoint / "config.json").read_text())["vocab_size"]
    data = batches(vocab, args.batch, args.seq, args.warmup + args.steps)
    with tempfile.TemporaryDirectory() as log_dir:
        if name.startswith("shiftlm"):
            step = shiftlm_stepper(
                args.checkpoint, device, name.endswith("compiled"), args.batch, args.seq, log_dir
            )
        else:
            step = hf_stepper(args.checkpoint, device, name.endswith("compiled"))
        losses, times = [], []
        for index, batch in enumerate(data):
            _sync(device)
            start = time.perf_counter()
            losses.append(step(batch))
            _sync(device)
            times.append(time.perf_counter() - start)
            if index == 0 and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)  # the steady state's peak, not the build's
    return {
        "first_step_s": times[0],
        "warmup_s": times[: args.warmup],
        "step_s": times[args.warmup :],
        "losses": losses,
        "peak_memory_gib": _peak_gib(device),
    }


def device_label(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def summarize(results: dict, tokens: int, flops_per_token: float, peak: float | None) -> tuple[dict, dict]:
    """Per variant measured so far: median step, tokens/s, MFU, ...; and the ratios the issue asks for."""
    summary = {}
    for variant, mine in results.items():
        if not mine["step_s"]:
            continue
        median = statistics.median(mine["step_s"])
        summary[variant] = {
            "median_step_s": median,
            "tokens_per_s": tokens / median,
            "mfu": tokens / median * flops_per_token / peak if peak else None,
            "first_step_s": mine["first_step_s"],
            "peak_memory_gib": mine["peak_memory_gib"],
            "first_loss": mine["losses"][0][0],
        }
    ratios = {}
    if "shiftlm_compiled" in summary and "hf_compiled" in summary:
        ratios["shiftlm_compiled_over_hf_compiled"] = (
            summary["shiftlm_compiled"]["tokens_per_s"] / summary["hf_compiled"]["tokens_per_s"]
        )
    if "shiftlm_compiled" in summary and "shiftlm_eager" in summary:
        ratios["shiftlm_compiled_over_eager"] = (
            summary["shiftlm_compiled"]["tokens_per_s"] / summary["shiftlm_eager"]["tokens_per_s"]
        )
    return summary, ratios


def write_json(path: Path, report: dict) -> None:
    """`report` at `path` through a temporary file: a kill mid-write leaves the previous one whole."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(temporary, path)


def main() -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer 64-wide Llama (smoke test)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (4; tiny: 2)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (2048; tiny: 64)")
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per variant per round (8; tiny: 2)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first compiles)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, alternating the variants' order")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset, in order")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per variant process")
    parser.add_argument(
        "--deadline",
        type=float,
        default=math.inf,
        help=f"seconds for the whole run (a variant needs what it took before, else {MIN_VARIANT_S:.0f} s)",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/gpu/...)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "shiftlm-gpu-train")
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="the Llama checkpoint (random weights written there if missing; default under --work)",
    )
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tiny = args.tiny
    args.batch = args.batch or (2 if tiny else 4)
    args.seq = args.seq or (64 if tiny else 2048)
    args.steps = args.steps or (2 if tiny else 8)
    if args.variant:  # a worker: one variant on --checkpoint, its result as the last line of stdout
        print(json.dumps(run_variant(args)), flush=True)
        return 0

    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    import torch

    from shiftlm.config import ModelConfig
    from shiftlm.hardware import device_peak_flops

    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is visible; use --device cpu --tiny for a smoke test")
        return 2
    name = device_label(device)
    work = args.work / ("tiny" if tiny else "1b")
    checkpoint = args.checkpoint or work / "checkpoint"
    write_checkpoint(checkpoint, MODEL_TINY if tiny else MODEL_1B, tokenizer=False, device=device)
    shape = {k: v for k, v in json.loads((checkpoint / "config.json").read_text()).items() if k in MODEL_1B}
    model = ModelConfig.from_hf(checkpoint)
    flops_per_token = model.flops_per_token(args.seq, causal=True)
    peak = device_peak_flops(name, "bf16") if device.startswith("cuda") else None
    tokens = args.batch * args.seq
    results: dict[str, dict] = {
        v: {"first_step_s": [], "step_s": [], "losses": [], "peak_memory_gib": 0.0} for v in variants
    }
    failures: dict[str, str] = {}
    skipped: list[str] = []
    took: dict[str, float] = {}  # seconds each variant's process took (its last round)
    report = {
        "device": name,
        "torch": torch.__version__,
        "model": "tiny llama (smoke)" if tiny else "llama 1.1B (TinyLlama's shape), random weights",
        "checkpoint": str(checkpoint),
        "shape": shape,
        "batch": args.batch,
        "seq_len": args.seq,
        "precision": "bf16 autocast, fp32 weights and AdamW moments" if device.startswith("cuda") else "fp32",
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "flops_per_token": flops_per_token,
        "peak_tflops_catalog": peak / 1e12 if peak else None,
        "deadline_s": args.deadline if args.deadline < math.inf else None,
        "summary": {},
        "ratios": {},
        "runs": results,
        "failures": failures,
        "skipped": skipped,
        "process_s": took,
    }
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") + ("_tiny" if tiny else "")
    out = args.out or ROOT / "bench" / "results" / "gpu" / f"gpu_train_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, report)
    for round_index in range(args.rounds):
        order = variants if round_index % 2 == 0 else variants[::-1]
        for variant in order:
            if variant in failures:
                continue
            label = f"round {round_index + 1} {variant}"
            left = max(started + args.deadline - time.monotonic(), 0.0)
            need = took.get(variant, MIN_VARIANT_S)
            if left < need:
                skipped.append(f"{label}: {left:.0f} s left, it needs ~{need:.0f} s")
                print(f"{label}: skipped, {left:.0f} s left", flush=True)
            else:
                variant_started = time.monotonic()
                limit = min(args.timeout, left)
                failure = measure(variant, args, checkpoint, limit, results[variant], label)
                took[variant] = time.monotonic() - variant_started
                if failure:
                    failures[variant] = failure
            report["summary"], report["ratios"] = summarize(results, tokens, flops_per_token, peak)
            write_json(out, report)
    brief = {k: report[k] for k in ("summary", "ratios", "skipped")}
    print(json.dumps(brief | {"out": str(out), "failures": list(failures)}))
    return 1 if failures else 0


def measure(variant: str, args, checkpoint: Path, limit: float, mine: dict, label: str) -> str | None:
    """`variant` in a worker process of its own, killed whole (inductor's compile workers too) past
    `limit` seconds; its timings, losses and peak memory added to `mine`. Returns why it failed."""
    command = [
        sys.executable,
        __file__,
        f"--variant={variant}",
        f"--checkpoint={checkpoint}",
        f"--device={args.device}",
        f"--batch={args.batch}",
        f"--seq={args.seq}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
    ]
    code, stdout, stderr = run_group(command, limit, cwd=ROOT)
    if code == "timeout":
        print(f"{label}: over its limit of {limit:.0f} s", flush=True)
        return f"over its limit of {limit:.0f} s"
    if code != 0:
        print(f"{label}: failed\n{stderr[-1500:]}", flush=True)
        return stderr[-3000:]
    one = json.loads(stdout.strip().splitlines()[-1])
    mine["first_step_s"].append(one["first_step_s"])
    mine["step_s"] += one["step_s"]
    mine["losses"].append(one["losses"])
    mine["peak_memory_gib"] = max(mine["peak_memory_gib"], one["peak_memory_gib"])
    median = statistics.median(one["step_s"])
    print(f"{label}: first step {one['first_step_s']:.1f} s, median {median * 1e3:.1f} ms", flush=True)
    return None


if __name__ == "__main__":
    sys.exit(main())
