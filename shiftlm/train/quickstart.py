"""`shiftlm quickstart`: the whole loop on a laptop in a few minutes, with nothing downloaded.

Trains the embedded default (a tiny Llama on the Python standard library's source, with a byte-level
BPE tokenizer trained on the same text) on 2 local CPU ranks (dp = 2), exports it to OUT/hf in
Hugging Face format (what `shiftlm serve` loads), and prints a few samples from it.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

PROMPTS = ["def ", "import os\n", "class ", '    """Return the']


def quickstart_config(out: Path, steps: int):
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
            "--checkpoint.resume=false",
            "--checkpoint.overwrite=true",  # OUT is quickstart's own run dir: each run starts afresh
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
    from shiftlm.train.tokenizer import read_tokenizer_json

    model = build_model(ModelConfig.from_hf(model_dir), checkpoint=model_dir)
    tokenizer = read_tokenizer_json(model_dir)
    generator = torch.Generator().manual_seed(seed)
    texts = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt).ids])
        for _ in range(max_new_tokens):
            logits = model(ids)[0, -1] / temperature
            threshold = logits.topk(top_k).values[-1]
            probs = torch.softmax(logits.masked_fill(logits < threshold, float("-inf")), dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator).view(1, 1)], dim=1)
        texts.append(tokenizer.decode(ids[0].tolist()))
    return texts


def quickstart(out: Path, steps: int | None = None, quiet: bool = False) -> dict:
    from shiftlm.train.elastic import launch
    from shiftlm.train.export import export_checkpoint

    started = time.perf_counter()
    config = quickstart_config(out, steps or 200)
    if not quiet:
        print(f"training the embedded default (tiny Llama, stdlib corpus) on 2 CPU ranks -> {out}")
    summary = launch(config, nproc=2, quiet=quiet)
    hf_dir = export_checkpoint(out, out / "hf")
    texts = sample(hf_dir, PROMPTS)
    if not quiet:
        print(f"\nexported {hf_dir} (config.json, model.safetensors, tokenizer) -- samples:")
        for text in texts:
            print("-" * 60 + "\n" + text)
    losses = summary["losses"]
    return {
        "hf_dir": str(hf_dir),
        "steps": summary["steps"],
        "first_loss": losses[min(losses)],
        "final_loss": losses[max(losses)],
        "samples": texts,
        "seconds": time.perf_counter() - started,
    }
