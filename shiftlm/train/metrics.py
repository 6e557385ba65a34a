"""What a training run reports: one line per step, a progress bar on a terminal, JSONL, a loss plot
(training and held-out validation loss), and TensorBoard scalars when `tensorboard` is installed.

Model FLOPs per token are `ModelConfig.flops_per_token` (PaLM's 6 N + 12 L d S, the formula the
simulator uses too), with causal attention counted as the causal SDPA executes it. Recomputation is
not counted: MFU measures useful work. The peak comes from the hardware catalog by device name
(`shiftlm.hardware.device_peak_flops`); where the device is unknown (any CPU) MFU reads "n/a" rather
than a guessed peak.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from shiftlm.config import ModelConfig


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process: allocated on its GPU, or resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB


def throughput(
    model: ModelConfig, seq_len: int, sequences: int, step_time: float, devices: int, peak: float | None
) -> tuple[float, float, float | None]:
    """(tokens/s, model FLOP/s per device, MFU or None without a known peak) of a step that trained
    `sequences` sequences of `seq_len` tokens on `devices` devices in `step_time` seconds."""
    tokens_per_s = sequences * seq_len / step_time
    achieved = model.flops_per_token(seq_len, causal=True) * tokens_per_s / devices
    return tokens_per_s, achieved, (achieved / peak if peak else None)


@dataclass
class StepRecord:
    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    tflops_per_device: float
    mfu: float | None
    memory_gb: float
    step_time_s: float
    eta_s: float
    val_loss: float | None = None  # the held-out loss, on the steps validation ran


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


def format_step(record: StepRecord, total_steps: int) -> str:
    mfu = "n/a" if record.mfu is None else f"{100 * record.mfu:.1f}%"
    return (
        f"step {record.step:>{len(str(total_steps))}}/{total_steps} | loss {record.loss:.4f} | "
        f"lr {record.lr:.2e} | grad norm {record.grad_norm:.3f} | {record.tokens_per_s:,.0f} tok/s | "
        f"{record.tflops_per_device:.3f} TFLOP/s | MFU {mfu} | mem {record.memory_gb:.2f} GB | "
        f"ETA {_duration(record.eta_s)}"
        + ("" if record.val_loss is None else f" | val loss {record.val_loss:.4f}")
    )


class RunLog:
    """Rank 0's reporter: log lines (stdout), a progress bar (stderr, on a terminal), metrics.jsonl."""

    def __init__(self, out_dir: Path, total_steps: int, progress: str = "auto", quiet: bool = False):
        self.out_dir, self.total_steps, self.quiet = out_dir, total_steps, quiet
        out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_file = out_dir / "metrics.jsonl"
        self.records: list[StepRecord] = []
        self.bar = progress == "on" or (progress == "auto" and sys.stderr.isatty())
        self._started = time.perf_counter()
        # opened at the first step, not here: a fresh start with --overwrite clears log.dir (its old
        # tensorboard/ included) after the log is made, and would delete an open writer's event file
        self.tensorboard = None
        self._tensorboard_opened = False

    def step(self, record: StepRecord, first_step: int) -> None:
        self.records.append(record)
        with open(self.metrics_file, "a") as handle:
            handle.write(json.dumps(asdict(record)) + "\n")
        if not self._tensorboard_opened:
            self._tensorboard_opened = True
            self.tensorboard = _tensorboard_writer(self.out_dir / "tensorboard", self.quiet)
        if self.tensorboard is not None:
            for key in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "memory_gb", "mfu"):
                value = getattr(record, key)
                if value is not None:
                    self.tensorboard.add_scalar(f"train/{key}", value, record.step)
            self.tensorboard.flush()
        if self.quiet:
            return
        if self.bar:
            sys.stderr.write("\r\033[K")
        print(format_step(record, self.total_steps), flush=True)
        if self.bar:
            done = record.step - first_step + 1
            width = 30
            filled = int(width * record.step / self.total_steps)
            rate = done / max(time.perf_counter() - self._started, 1e-9)
            sys.stderr.write(
                f"[{'#' * filled}{'.' * (width - filled)}] {record.step}/{self.total_steps} {rate:.2f} it/s"
            )
            sys.stderr.flush()

    def finish(self) -> Path | None:
        """Write loss.png from every step in metrics.jsonl (including earlier, resumed runs)."""
        if self.bar:
            sys.stderr.write("\n")
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if not self.metrics_file.is_file():
            return None
        by_step, val_by_step = {}, {}
        for line in self.metrics_file.read_text().splitlines():
            row = json.loads(line)
            by_step[row["step"]] = row["loss"]  # a resumed run re-logs steps: keep the latest
            if row.get("val_loss") is not None:
                val_by_step[row["step"]] = row["val_loss"]
        return plot_loss(sorted(by_step.items()), self.out_dir / "loss.png", sorted(val_by_step.items()))


def _tensorboard_writer(directory: Path, quiet: bool):
    """A TensorBoard SummaryWriter if `tensorboard` is installed; else None, said once."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        if not quiet:
            print("tensorboard is not installed: metrics go to metrics.jsonl only (pip install tensorboard)")
        return None
    return SummaryWriter(log_dir=str(directory))


def plot_loss(
    points: list[tuple[int, float]], path: Path, validation: list[tuple[int, float]] | None = None
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.plot([s for s, _ in points], [loss for _, loss in points], linewidth=1.2, label="training")
    if validation:
        axes.plot([s for s, _ in validation], [v for _, v in validation], "o-", label="held-out")
        axes.legend()
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
