"""Peak memory and time of the LM head + loss, materialised logits against the chunked head (`train.loss_chunk`).

    python bench/chunked_loss.py --out bench/results/chunked_loss.json

Two measurements, each in a fresh process (a second profiler session in one process misses events),
fp32 on the CPU, allocation accounting (torch.profiler's memory events, `train/memory_probe.py`):
- `loss`: forward + backward of head + cross-entropy alone on `--tokens` tokens of width `--hidden`
  at a `--vocab` vocabulary; the peak counts only what the two allocate beyond their inputs;
- `step`: the trainer's whole peak over 2 steps of a small model with that vocabulary (1 rank).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from shiftlm.config import ModelConfig
from shiftlm.launch import LocalWorkers
from shiftlm.train.memory_probe import MIB, allocation_peak, profiled_events

STEP_MODEL = dict(
    hidden_size=256, intermediate_size=704, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64
)


def loss_peak(tokens: int, hidden: int, vocab: int, chunk: int) -> dict:
    """Peak bytes the head + loss allocate (forward and backward) beyond their inputs, and the time."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from shiftlm.comm import SINGLE
    from shiftlm.model.loss import chunked_head_cross_entropy

    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, requires_grad=True)
    weight = (torch.randn(vocab, hidden) / hidden**0.5).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,))

    def run() -> None:
        if chunk:
            loss = chunked_head_cross_entropy(x, weight, targets, SINGLE, 0, None, chunk)
        else:  # what Transformer.head + loss do on one rank
            loss = F.cross_entropy(F.linear(x, weight).float(), targets, reduction="none")
        loss.sum().backward()
        x.grad = weight.grad = None

    run()  # warm
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    live = peak = 0
    memory = (e for e in profiled_events(prof) if e.get("name") == "[memory]")
    for event in sorted(memory, key=lambda e: e["ts"]):
        live += event["args"]["Bytes"]
        peak = max(peak, live)
    return {"peak_mib": round(peak / MIB, 1), "seconds": round(seconds, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--chunk", type=int, default=1024, help="the chunked side's tokens per chunk")
    parser.add_argument(
        "--step-seq", type=int, default=512, help="the trainer step's seq_len (micro-batch 4)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/chunked_loss.json"))
    args = parser.parse_args()
    result: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "loss": {}, "step": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(
            json.dumps(ModelConfig(vocab_size=args.vocab, **STEP_MODEL).to_hf_dict())
        )
        run = [
            f"--model.name={model_dir}",
            f"--train.seq_len={args.step_seq}",
            "--train.micro_batch=4",
            "--train.global_batch=4",
            "--train.compile=false",
            "--monitor.straggler_every=0",
        ]
        for name, chunk in (("materialised", 0), ("chunked", args.chunk)):
            with LocalWorkers(1) as workers:
                result["loss"][name] = workers.run(loss_peak, args.tokens, args.hidden, args.vocab, chunk)[0]
            with LocalWorkers(1) as workers:
                step = workers.run(allocation_peak, [*run, f"--train.loss_chunk={chunk}"], f"{tmp}/{name}")[0]
            result["step"][name] = {"peak_mib": round(step["peak_bytes"] / MIB, 1)}
            print(name, result["loss"][name], result["step"][name], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
