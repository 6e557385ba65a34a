"""`shiftlm quickstart`: the whole loop on a laptop in a few minutes, with nothing downloaded.

Trains the embedded default (a tiny Llama on the Python standard library's source, with a byte-level
BPE tokenizer trained on the same text) on 2 local CPU ranks (dp = 2), exports it to OUT/hf in
Hugging Face format (what `shiftlm serve` loads), and prints a few samples from it, then where
everything went and what to run next.

A rerun never deletes the previous run silently: an unfinished run in OUT (Ctrl-C saves one) is
resumed, a finished one is refused with exit 6 naming `--overwrite` (as `shiftlm train` refuses a
used run directory).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from shiftlm.errors import check_writable_dir

PROMPTS = ["def ", "import os\n", "class ", '    """Return the']


def quickstart_config(out: Path, steps: int, overwrite: bool = False):
    from shiftlm.train.config import load_config

    return load_config(
        None,
        [
            "--model.name=tiny",
            "--parallel.dp=2",
            "--train.seq_len=128",
            "--train.micro_batch=8",
            "--train.global_batch=16",
            f"--train.steps={steps}",
            "--optim.lr=0.01",
            "--optim.min_lr=0.001",
            "--optim.warmup_steps=20",
            f"--checkpoint.every={max(steps // 2, 1)}",
            f"--log.dir={out}",
            f"--checkpoint.resume={str(not overwrite).lower()}",  # an interrupted quickstart goes on
            f"--checkpoint.overwrite={str(overwrite).lower()}",
        ],
    )


@torch.no_grad()
def sample(
    model_dir: Path,
    prompts: list[str],
    max_new_tokens: int = 48,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
) -> list[str]:
    """Top-k samples from an exported model, with shiftlm's own (single-rank) model."""
    from shiftlm.config import ModelConfig
    from shiftlm.model import build_model
    from shiftlm.model.ops import InferenceOps
    from shiftlm.train.tokenizer import read_tokenizer_json

    model = build_model(ModelConfig.from_hf(model_dir), checkpoint=model_dir)
    tokenizer = read_tokenizer_json(model_dir)
    generator = torch.Generator().manual_seed(seed)
    texts = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt).ids])
        for _ in range(max_new_tokens):
            logits = model(ids, ops=InferenceOps())[0, -1] / temperature  # serving's no-grad GEMMs
            threshold = logits.topk(top_k).values[-1]
            probs = torch.softmax(logits.masked_fill(logits < threshold, float("-inf")), dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator).view(1, 1)], dim=1)
        texts.append(tokenizer.decode(ids[0].tolist()))
    return texts


def previous_run(out: Path, steps: int, overwrite: bool) -> int:
    """The step an earlier quickstart in `out` reached (0: none, or --overwrite); a finished one is
    refused rather than deleted."""
    from shiftlm.errors import RunDirError
    from shiftlm.train.checkpoint import latest_checkpoint, read_trainer_state

    latest = None if overwrite else latest_checkpoint(out / "checkpoints")
    if latest is None:
        return 0
    step = read_trainer_state(latest)["step"]
    if step >= steps:
        raise RunDirError(
            f"{out} holds a finished quickstart run ({latest}, step {step}; model in {out / 'hf'}): pass "
            f"--overwrite to train afresh (deletes it), or --out OTHER_DIR to keep it"
        )
    return step


def quickstart(out: Path, steps: int | None = None, quiet: bool = False, overwrite: bool = False) -> dict:
    from shiftlm.train.elastic import launch
    from shiftlm.train.export import export_checkpoint

    started = time.perf_counter()
    steps = steps or 200
    check_writable_dir(out, "--out")  # before any rank starts: a rank failing on it printed a traceback
    resumed = previous_run(out, steps, overwrite)
    config = quickstart_config(out, steps, overwrite)
    if not quiet:
        what = (
            f"resuming the unfinished run in {out} at step {resumed}" if resumed else f"training into {out}"
        )
        # measured on 2 cores: ~15 s from here to step 1 (2 processes import torch, join a process
        # group, build the tokenizer's vocabulary and the model), then ~0.4 s a step
        print(
            f"quickstart: {what} (tiny Llama on the stdlib corpus, dp = 2 on 2 CPU ranks, {steps} steps); "
            "starting the ranks, ~15 s before step 1",
            flush=True,
        )
    summary = launch(config, nproc=2, quiet=quiet)
    losses = summary["losses"]
    result = {
        "run_dir": str(out),
        "steps": summary["steps"],
        "first_loss": losses[min(losses)] if losses else None,
        "final_loss": losses[max(losses)] if losses else None,
        "checkpoint": summary["checkpoint"],
        "metrics": summary["metrics"],
        "loss_plot": summary["loss_plot"],
        "interrupted": summary.get("interrupted", 0),
        "resumed_from_step": resumed,
    }
    if result["interrupted"]:  # stopped with a checkpoint: no export, the CLI says how to go on
        return {**result, "hf_dir": None, "samples": [], "seconds": time.perf_counter() - started}
    hf_dir = export_checkpoint(out, out / "hf")
    if not quiet:
        print(f"exported {hf_dir}; sampling {len(PROMPTS)} completions of 48 tokens from it", flush=True)
    texts = sample(hf_dir, PROMPTS)
    if not quiet:
        for text in texts:
            print("-" * 60 + "\n" + text)
        print("-" * 60)
    return {**result, "hf_dir": str(hf_dir), "samples": texts, "seconds": time.perf_counter() - started}


def next_steps(result: dict) -> str:
    """The quickstart's last lines: where everything went, the final loss, what to run next."""
    hf = result["hf_dir"]
    return "\n".join(
        [
            f"quickstart done in {result['seconds']:.0f} s: {result['steps']} steps, loss "
            f"{result['first_loss']:.3f} -> {result['final_loss']:.3f}",
            f"  model (Hugging Face)  {hf}",
            f"  checkpoint            {result['checkpoint']}",
            f"  metrics               {result['metrics']}",
            f"  loss plot             {result['loss_plot']}",
            "next:",
            f"  shiftlm serve --model {hf} --tp 1 --sp 2 --port 8000       # OpenAI API; then:",
            f"  curl localhost:8000/v1/completions -H 'content-type: application/json' "
            f"""-d '{{"model": "{hf}", "prompt": "def ", "max_tokens": 32}}'""",
            f"  shiftlm verify --model {hf} --tp 1,2 --sp 1,2             # layouts vs transformers",
            f"  shiftlm quickstart --out {result['run_dir']} --steps {result['steps'] * 2}"
            "                   # train on from this checkpoint",
        ]
    )
