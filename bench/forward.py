"""Single-rank forward+backward throughput: shiftlm vs Hugging Face `transformers`, same config and batch.

    python bench/forward.py                 # table + bench/results/forward.json
    python bench/forward.py --steps 20 --json

Both models hold identical weights (shiftlm loads the checkpoint `transformers` just wrote); the two are
timed alternately, step by step, in one process so that machine noise hits both alike. A step is a
forward pass, the mean next-token cross-entropy, and a backward pass; tokens/s counts batch x seq.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from shiftlm.config import ModelConfig
from shiftlm.model import build_model


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "forward.json"))
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def step(model, ids, targets, ours: bool) -> None:
    model.zero_grad(set_to_none=True)
    if ours:
        loss = model.loss(model(ids), targets).sum() / targets.numel()
    else:
        logits = model(ids).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    hf_config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(2048, args.seq),
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config).float()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = build_model(ModelConfig.from_hf(tmp), checkpoint=tmp)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    targets = torch.roll(ids, -1, dims=1)
    for model, is_ours in ((hf, False), (ours, True)):  # warm-up
        step(model, ids, targets, is_ours)
    times = {"hf": [], "shiftlm": []}
    for i in range(args.steps):
        for name, model, is_ours in (("hf", hf, False), ("shiftlm", ours, True)):
            start = time.perf_counter()
            step(model, ids, targets, is_ours)
            times[name].append(time.perf_counter() - start)
        print(
            f"step {i + 1}/{args.steps}: hf {times['hf'][-1] * 1e3:.0f} ms, "
            f"shiftlm {times['shiftlm'][-1] * 1e3:.0f} ms",
            file=sys.stderr,
            flush=True,
        )
    tokens = args.batch * args.seq
    result = {
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "json")},
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "median_step_s": {k: statistics.median(v) for k, v in times.items()},
        "tokens_per_s": {k: tokens / statistics.median(v) for k, v in times.items()},
    }
    result["speedup_vs_hf"] = result["tokens_per_s"]["shiftlm"] / result["tokens_per_s"]["hf"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{'model':<10}{'median step (ms)':>18}{'tokens/s':>12}")
        for name in ("hf", "shiftlm"):
            print(
                f"{name:<10}{result['median_step_s'][name] * 1e3:>18.1f}{result['tokens_per_s'][name]:>12.0f}"
            )
        print(f"shiftlm / hf: {result['speedup_vs_hf']:.2f}x  -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
