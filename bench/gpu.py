"""shiftlm on one CUDA GPU: the checks a lent GPU runs (correctness, training, serving), one JSON each.

    python bench/gpu.py --out bench/results/gpu            # every phase, each in its own process
    python bench/gpu.py --phase verify --out DIR           # one phase

Phases (each a subprocess with its own time limit, so one failure leaves the others' results):
- env: the device, driver, torch / transformers versions, and a bf16 GEMM's rate (the ceiling).
- cuda_tests: the suite's `cuda`-marked tests (`pytest -m cuda`), which skip without a GPU.
- verify: `shiftlm verify --device cuda` in fp32 (<= 1e-5 relative to transformers on the same GPU) and
  in bf16 autocast (within 2x transformers' own bf16 error vs fp32), on the tiny llama-gqa, qwen2 and
  mistral checkpoints and on a 1024-wide Llama at 512 tokens (SDPA's fused kernels apply there).
- train: `torchrun --nproc-per-node 1 -m shiftlm train` on a ~1.1B Llama (TinyLlama's shape) at 4 x 2048 (the user's
  command, its default `train.compile`): its own tokens/s, MFU and memory per step from metrics.jsonl.
- train_compile: bench/gpu_train.py (shiftlm compiled / eager against transformers compiled / eager,
  one process each) on that model's checkpoint, inside the phase's limit; its JSON lands beside the
  others.
- calibrate: `shiftlm calibrate` on the GPU, then `shiftlm simulate train --gpu this` for the same run.
- serve: `shiftlm serve` on one GPU: greedy completions in fp32 equal transformers' `generate` on the
  same GPU; then `shiftlm bench serve` replays the Azure conversation trace against the ~1.1B model in
  bf16 (the default on GPUs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def phase_limits(phases: dict[str, int]) -> dict[str, int]:
    """`phases` with the limits of SHIFTLM_GPU_LIMITS="name=seconds,..." (bench/gpu_session.sh fits a
    short GPU loan with it); the phases' own processes inherit it."""
    for item in filter(None, os.environ.get("SHIFTLM_GPU_LIMITS", "").split(",")):
        name, _, seconds = item.partition("=")
        if not seconds.isdigit():
            raise SystemExit(f"SHIFTLM_GPU_LIMITS: {item!r} is not name=seconds (e.g. decode=200)")
        if name in phases:  # a name of the other script's phases (gpu.py / gpu_serve.py share it)
            phases[name] = int(seconds)
    return phases


PHASES = phase_limits(
    {
        "env": 60,
        "cuda_tests": 300,
        "verify": 200,
        "train": 150,
        "train_compile": 540,
        "calibrate": 150,
        "serve": 220,
    }
)  # seconds each (SHIFTLM_GPU_LIMITS overrides them)
# TinyLlama-1.1B's shape (Zhang et al. 2024)
MODEL_1B = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
)
MODEL_MID = dict(
    MODEL_1B, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16
)


# --smoke: every phase on the CPU with small shapes, to check this script without a GPU
SMOKE = os.environ.get("SHIFTLM_GPU_SMOKE") == "1"
DEVICE = "cpu" if SMOKE else "cuda"
if SMOKE:
    MODEL_1B = dict(
        MODEL_1B,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4000,
    )
    MODEL_MID = dict(MODEL_1B)


def work_dir() -> Path:
    path = Path(os.environ.get("SHIFTLM_GPU_WORK", "/tmp/shiftlm-gpu"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_group(
    command: list[str], timeout: float, capture: bool = True, **popen
) -> tuple[int | str, str, str]:
    """`command` in a session of its own: (its return code, or "timeout" past `timeout` seconds; its
    stdout and stderr, "" uncaptured). On a timeout its whole tree is killed, so nothing of it keeps
    the GPU's memory from what runs next; what it printed before is kept."""
    pipe = subprocess.PIPE if capture else None
    with subprocess.Popen(
        command, stdout=pipe, stderr=pipe, text=True, start_new_session=True, **popen
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
            code = process.returncode
        except subprocess.TimeoutExpired:
            kill_tree(process.pid)
            stdout, stderr = process.communicate(timeout=30)
            code = "timeout"
    return code, stdout or "", stderr or ""


def kill_tree(pid: int) -> None:
    """SIGKILL the process group of `pid` and those of its descendants: torchrun (and gpu_train.py)
    start their workers in sessions of their own, out of the group. Stopped first, the tree cannot
    grow between the look in /proc and the kill."""
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for group in _tree_groups(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, sig)


def _tree_groups(pid: int) -> set[int]:
    """The process groups of `pid` and of its descendants (from /proc/*/stat: ppid, pgrp)."""
    children: dict[int, list[int]] = {}
    groups = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[1:3]  # after the name: state ppid pgrp
        except OSError:  # ended meanwhile
            continue
        children.setdefault(int(ppid), []).append(int(stat.parent.name))
        groups[int(stat.parent.name)] = int(pgrp)
    found, todo = {pid}, [pid]  # pid's own group is pid (start_new_session)
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(groups[child])
            todo.append(child)
    return found


def checkpoint(path: Path, shape: dict, tokenizer: bool = True, device: str | None = None) -> Path:
    """A random-weight Llama written by transformers, made on `device` (default the bench's: a 1.1B
    init on the CPU is slow)."""
    if (path / "config.json").exists():
        return path
    import torch
    import transformers as tf

    config = tf.LlamaConfig(**shape)
    torch.manual_seed(0)
    with torch.device(device or DEVICE):
        model = tf.LlamaForCausalLM(config).float()
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer:
        from shiftlm.serve.engine.tokenizer import write_char_tokenizer

        write_char_tokenizer(path, vocab_size=shape["vocab_size"])
    del model
    torch.cuda.empty_cache()
    return path


def config_json(path: Path, shape: dict) -> Path:
    """`shape`'s config.json alone (what `simulate train --model` reads): no weights to write."""
    import transformers as tf

    tf.LlamaConfig(**shape).save_pretrained(path)
    return path / "config.json"


def phase_env(out: Path) -> dict:
    import torch
    import transformers

    size = 1024 if SMOKE else 8192
    name = "cpu" if SMOKE else torch.cuda.get_device_name(0)
    a = torch.randn(size, size, device=DEVICE, dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    _sync()
    start = time.perf_counter()
    for _ in range(10):
        a @ a
    _sync()
    tflops = 10 * 2 * size**3 / (time.perf_counter() - start) / 1e12
    query = [
        "nvidia-smi",
        "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
        "--format=csv,noheader",
    ]
    smi = "" if SMOKE else subprocess.run(query, capture_output=True, text=True).stdout.strip()
    return {
        "device": name,
        "nvidia_smi": smi,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "bf16_gemm_8192_tflops": round(tflops, 1),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
    }


def _sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _verify(args: list[str]) -> dict:
    returncode, stdout, stderr = run_group(
        [
            sys.executable,
            "-m",
            "shiftlm.cli",
            "verify",
            "--device",
            DEVICE,
            "--tp",
            "1",
            "--sp",
            "1",
            "--json",
            *args,
        ],
        120,
    )
    if returncode not in (0, 1) or not stdout.strip():
        return {"args": args, "returncode": returncode, "stderr": stderr[-3000:]}
    report = json.loads(stdout)
    report["args"] = args
    return report


def phase_cuda_tests(out: Path) -> dict:
    """The suite's `cuda`-marked tests (they skip without a GPU: this is where they run), e.g. CUDA-graph
    decode steps equal to the eager step (tests/serve/test_decode_graphs.py)."""
    import torch

    command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-rA", "tests"]
    # on a timeout too, what ran: which tests passed before the limit
    returncode, stdout, _ = run_group(command, PHASES["cuda_tests"] - 10, cwd=ROOT)
    lines = stdout.strip().splitlines()
    return {
        "device": "cpu" if SMOKE else torch.cuda.get_device_name(0),
        "command": " ".join(command[1:]),
        "returncode": returncode,
        "results": [line for line in lines if line.startswith(("PASSED", "FAILED", "ERROR", "SKIPPED"))],
        "summary": lines[-1:] if lines else [],
        "failures_tail": stdout[-6000:] if returncode else "",
    }


def phase_verify(out: Path) -> dict:
    from shiftlm.tools.tiny import make_tiny_checkpoint

    work = work_dir()
    runs = []
    for family in ("llama-gqa", "qwen2", "mistral"):
        model = str(make_tiny_checkpoint(work / f"tiny-{family}", family))
        for dtype in ("float32", "bfloat16"):
            runs.append(_verify(["--model", model, "--dtype", dtype]))
    mid = str(checkpoint(work / "llama-mid", MODEL_MID, tokenizer=False))
    for dtype in ("float32", "bfloat16"):
        runs.append(
            _verify(["--model", mid, "--dtype", dtype, "--batch", "2", "--seq-len", "64" if SMOKE else "512"])
        )
    return {"passed": all(r.get("passed") is True for r in runs), "runs": runs}


def phase_train(out: Path, steps: int = 15) -> dict:
    """The user's command on the 1.1B model at 4 x 2048 (micro and global batch 4), `train.compile` at
    its default (auto: compiled decoder layers on CUDA), without checkpoints (`checkpoint.enable =
    false`: the last step's save would write ~13 GB of fp32 weights and AdamW moments)."""
    started = time.monotonic()
    path = checkpoint(work_dir() / "llama-1b", MODEL_1B)
    run_dir = work_dir() / "train-run"
    shutil.rmtree(run_dir, ignore_errors=True)  # an earlier run's metrics are no result of this one
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "1",
        "-m",
        "shiftlm",
        "train",
        f"--model.name={path}",
        f"--train.seq_len={64 if SMOKE else 2048}",
        "--train.micro_batch=4",
        "--train.global_batch=4",
        f"--train.steps={5 if SMOKE else steps}",
        f"--train.device={DEVICE}",
        "--optim.warmup_steps=2",
        f"--log.dir={run_dir}",
        "--log.progress=off",
        "--checkpoint.enable=false",
    ]
    launched = time.monotonic()
    # 10 s of the phase's limit for this process's start and for reading back what the run wrote
    returncode, stdout, stderr = run_group(command, PHASES["train"] - 10 - (launched - started))
    wall = time.monotonic() - launched
    metrics = []
    metrics_file = run_dir / "metrics.jsonl"
    if metrics_file.exists():  # written step by step: a timeout keeps the steps before it
        metrics = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    steady = metrics[3:]  # the first steps build the compiled layers and the fused AdamW
    measured = {  # mfu and memory_gb are null on the CPU
        key: [m[key] for m in steady if m.get(key) is not None]
        for key in ("tokens_per_s", "mfu", "step_time_s", "memory_gb")
    }
    return {
        "command": " ".join(command[1:]),
        "train_compile": "auto (the default): compiled decoder layers on CUDA, eager on the CPU",
        "returncode": returncode,
        "wall_s": round(wall, 1),
        "median_after_3_steps": {key: statistics.median(v) if v else None for key, v in measured.items()},
        "stdout_tail": stdout[-4000:],
        "stderr_tail": stderr[-4000:],
        "metrics": metrics,
    }


def phase_train_compile(out: Path) -> dict:
    """bench/gpu_train.py in a subprocess (its variants are processes of their own), one round on
    phase_train's checkpoint (one 4.4 GB write for both), its --deadline inside this phase's limit;
    the detail JSON it wrote after each variant is read back however it ended."""
    started = time.monotonic()
    path = checkpoint(work_dir() / "llama-1b", MODEL_1B)
    # 15 s for this process's start and its own end; gpu_train gets 10 s past its deadline to write
    left = PHASES["train_compile"] - 15 - (time.monotonic() - started)
    detail = out / "gpu_train_compile_detail.json"
    detail.unlink(missing_ok=True)  # an earlier run's is no result of this one
    command = [sys.executable, str(ROOT / "bench" / "gpu_train.py"), f"--device={DEVICE}"]
    command += ["--tiny"] if SMOKE else ["--steps=10", "--timeout=150"]
    command += [f"--checkpoint={path}", "--rounds=1", f"--deadline={left - 10:.0f}"]
    command += [f"--out={detail}"]
    returncode, stdout, stderr = run_group(command, left)
    return {
        "command": " ".join(command[1:]),
        "returncode": returncode,
        "result": json.loads(detail.read_text()) if detail.exists() else None,
        "stdout_tail": stdout[-3000:],
        "stderr_tail": stderr[-3000:],
    }


def phase_calibrate(out: Path) -> dict:
    """`shiftlm calibrate` (the GPU path), then the simulator's step for the bench's 1.1B run, compiled
    and eager."""
    profile = out / "hardware_this.json"
    calibrate = [sys.executable, "-m", "shiftlm", "calibrate", "--out", str(profile), "--json"]
    returncode, stdout, stderr = run_group(calibrate, PHASES["calibrate"] - 40)
    result = {"calibrate_returncode": returncode, "calibrate_stderr_tail": stderr[-3000:]}
    if returncode == 0:
        result["profile"] = json.loads(stdout.strip().splitlines()[-1])
        model = config_json(work_dir() / "llama-1b-config", MODEL_1B)
        simulate = [
            sys.executable,
            "-m",
            "shiftlm",
            "simulate",
            "train",
            "--gpu",
            "this",
            "--hardware",
            str(profile),
            "--model",
            str(model),
            "--seq",
            "64" if SMOKE else "2048",
            "--global-batch",
            "4",
            "--micro-batch",
            "4",
            "--gpus",
            "1",
            "--recompute",
            "none",
            "--dtype",
            "fp32" if SMOKE else "bf16",
            "--json",
        ]
        # both modes of `shiftlm train --train.compile=...` (15 s each: the 30 s one run had)
        for mode, key in (("--compile", "simulate_compiled"), ("--no-compile", "simulate_eager")):
            returncode, stdout, stderr = run_group([*simulate, mode], 15)
            result[key] = {
                "command": " ".join([*simulate[3:], mode]),
                "returncode": returncode,
                "stdout_tail": stdout[-4000:],
                "stderr_tail": stderr[-2000:],
            }
    return result


def _complete(url: str, model: str, prompt: list[int], max_tokens: int) -> str:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def phase_serve(out: Path) -> dict:
    import torch
    import transformers as tf

    from shiftlm.serve.local_server import local_server
    from shiftlm.serve.replay import first_model

    tf.logging.set_verbosity_error()
    work = work_dir()
    result: dict = {}
    # greedy parity in fp32: the server's tokens against transformers' generate on the same GPU
    small = checkpoint(work / "llama-mid-tok", MODEL_MID)
    hf = tf.AutoModelForCausalLM.from_pretrained(small, torch_dtype=torch.float32).to(DEVICE).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, MODEL_MID["vocab_size"], (n,), generator=g).tolist() for n in (5, 37, 130)]
    tokenizer = tf.AutoTokenizer.from_pretrained(small)
    want_ids, want = [], []  # the char tokenizer spells every id uniquely: equal text is equal tokens
    for prompt in prompts:
        ids = torch.tensor([prompt], device=DEVICE)
        gen = hf.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24, pad_token_id=0)
        want_ids.append(gen[0, len(prompt) :].tolist())
        want.append(tokenizer.decode(want_ids[-1], skip_special_tokens=True))
    del hf
    torch.cuda.empty_cache()
    log = work / "serve-fp32.log"
    started = time.perf_counter()
    with local_server(
        ["--model", str(small), "--dtype", "float32", "--device", DEVICE], log_path=str(log)
    ) as server:
        result["fp32_server_start_s"] = round(time.perf_counter() - started, 1)
        served = first_model(server.url)
        got = [_complete(server.url, served, prompt, 24) for prompt in prompts]
    result["greedy_fp32"] = {
        "hf_ids": want_ids,
        "hf_text": want,
        "server_text": got,
        "identical": got == want,
    }
    result["fp32_server_log_tail"] = log.read_text()[-2000:]
    # the Azure conversation trace against the ~1.1B model in bf16 (the GPU default)
    big = checkpoint(work / "llama-1b", MODEL_1B)
    trace = ROOT / "shiftlm" / "data" / "traces" / "azure_llm_2023_conv.csv.gz"
    command = [
        sys.executable,
        "-m",
        "shiftlm.cli",
        "bench",
        "serve",
        "--trace",
        str(trace),
        "--model",
        str(big),
        "--max-requests",
        "10" if SMOKE else "100",
        "--max-input",
        "1024",
        "--max-output",
        "256",
        "--num-blocks",
        "4096",
        "--max-tokens-per-step",
        "2048",
        "--json",
    ]
    started = time.perf_counter()
    returncode, stdout, stderr = run_group(command, 150)
    result["replay"] = {
        "command": " ".join(command[3:]),
        "returncode": returncode,
        "wall_s": round(time.perf_counter() - started, 1),
        "summary": json.loads(stdout.strip().splitlines()[-1]) if stdout.strip() else None,
        "stderr_tail": stderr[-3000:],
    }
    return result


def run_phase(name: str, out: Path) -> int:
    started = time.perf_counter()
    try:
        result = globals()[f"phase_{name}"](out)
        status = 0
    except Exception:
        result = {"error": traceback.format_exc()}
        status = 1
    result["phase_s"] = round(time.perf_counter() - started, 1)
    (out / f"gpu_{name}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k in ("error", "phase_s", "device")}), flush=True)
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu"))
    parser.add_argument("--phase", action="append", choices=list(PHASES), help="run only these (repeatable)")
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--smoke", action="store_true", help="every phase on the CPU, small (checks the script)"
    )
    args = parser.parse_args()
    if args.smoke and not SMOKE:
        os.environ["SHIFTLM_GPU_SMOKE"] = "1"
        return subprocess.run([sys.executable, *sys.argv], check=False).returncode
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    phases = args.phase or list(PHASES)
    if args.in_process:
        return max(run_phase(name, out) for name in phases)
    failed = []
    for name in phases:
        print(f"== {name} (limit {PHASES[name]} s)", flush=True)
        command = [sys.executable, __file__, "--in-process", "--phase", name, "--out", str(out)]
        code, _, _ = run_group(command, PHASES[name], capture=False)
        if code == "timeout":
            print(f"== {name}: over its {PHASES[name]} s limit", flush=True)
        if code:
            failed.append(name)
    print(f"done; failed: {failed or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
