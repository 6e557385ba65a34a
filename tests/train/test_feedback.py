"""What a training run tells its user: the memory estimate before launch (refusing what cannot fit),
a held-out validation loss that is the same on every layout, TensorBoard scalars when available."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest

from shiftlm.cli import main
from shiftlm.train.config import load_config
from shiftlm.train.data import split_holdout
from shiftlm.train.metrics import RunLog, StepRecord
from shiftlm.train.trainer import train

RUN = [
    "--model.name=micro",
    "--train.seq_len=32",
    "--train.global_batch=4",
    "--train.steps=4",
    "--log.progress=off",
    "--validation.freq=2",
    "--checkpoint.resume=false",
]


def test_a_model_that_cannot_fit_is_refused_before_launch_with_the_numbers(capsys, tmp_path):
    code = main(["train", "--model.name=llama3-8b", f"--log.dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 5 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    # 8.0e9 parameters x (4 weights + 8 gradient buffer and norm mask + 12 Adam and decay mask) ~ 180 GiB,
    # and the AdamW update's four fp32 temporaries (16 bytes per parameter) as the transient peak
    assert "llama3-8b needs ~299" in err and "optimizer 89.7" in err and "activations 119.6" in err
    assert not (tmp_path / "checkpoints").exists()


def test_the_estimate_is_printed_before_a_run_that_fits(capsys, tmp_path):
    assert main(["train", *RUN, "--train.steps=1", f"--log.dir={tmp_path}"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("memory estimate: ") and "GiB" in first


def test_the_held_out_tail_is_never_trained_on():
    class Dataset:
        def __len__(self):
            return 100

        def __getitem__(self, index):
            return np.array([index])

    training, held_out = split_holdout(Dataset(), 8)
    assert len(training) == 92 and len(held_out) == 8
    assert {held_out[i][0] for i in range(8)} == set(range(92, 100))
    assert max(training[i][0] for i in range(len(training))) == 91


def _validation_losses(overrides: list[str], log_dir: str) -> dict[int, float]:
    import torch.distributed as dist

    result = train(load_config(None, [*RUN, f"--log.dir={log_dir}", *overrides]), quiet=True)
    if dist.is_initialized():
        dist.barrier()
    return result.val_losses


def test_validation_loss_is_the_same_on_every_layout(ranks, tmp_path):
    one = ranks.run(1, _validation_losses, [], str(tmp_path / "one"))[0]
    assert sorted(one) == [2, 4]
    for overrides in (["--parallel.dp=2"], ["--parallel.pp=2"]):
        other = ranks.run(2, _validation_losses, overrides, str(tmp_path / overrides[0][2:]))[0]
        assert sorted(other) == [2, 4]
        for step in one:
            assert abs(other[step] - one[step]) <= 1e-5 * abs(one[step]), (overrides, other, one)


def _record(step: int) -> StepRecord:
    return StepRecord(step, 7.5, 1e-3, 0.9, 100.0, 0.001, None, 0.3, 0.1, 1.0, val_loss=7.6)


def test_without_tensorboard_one_info_line_and_metrics_still_written(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if absent
    log = RunLog(tmp_path, 2)
    log.step(_record(1), 1)
    out = capsys.readouterr().out
    assert out.count("tensorboard is not installed") == 1
    assert (tmp_path / "metrics.jsonl").read_text().count('"val_loss": 7.6') == 1


def _install_summary_writer(monkeypatch, writer_class) -> None:
    """`from torch.utils.tensorboard import SummaryWriter` gives `writer_class` (tensorboard is not a
    test dependency)."""
    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = writer_class
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)


def test_with_tensorboard_every_scalar_is_written(tmp_path, monkeypatch):
    written: list[tuple[str, float, int]] = []

    class Writer:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, tag, value, step):
            written.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            pass

    _install_summary_writer(monkeypatch, Writer)
    log = RunLog(tmp_path, 2)
    log.step(_record(1), 1)
    log.finish()
    assert ("train/loss", 7.5, 1) in written and ("train/val_loss", 7.6, 1) in written
    assert {tag for tag, _, _ in written} >= {"train/lr", "train/grad_norm", "train/tokens_per_s"}


def test_tensorboard_writer_survives_overwrite_clearing_the_run_dir(tmp_path, monkeypatch):
    """A fresh start with --overwrite clears log.dir (its old tensorboard/ too) after the RunLog is made:
    the writer, which keeps its event file open as SummaryWriter does, must be opened after that
    (on a GPU machine with tensorboard installed, the first flush failed with the file deleted)."""
    from shiftlm.train.checkpoint import clear_run

    class Writer:
        def __init__(self, log_dir):
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self.events = Path(log_dir) / "events.out.tfevents"
            self.events.write_text("")

        def add_scalar(self, tag, value, step):
            with open(self.events, "r+") as handle:  # as the event writer appends to its open file
                handle.seek(0, 2)
                handle.write(f"{tag} {value} {step}\n")

        def flush(self):
            pass

        def close(self):
            pass

    _install_summary_writer(monkeypatch, Writer)
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "old-run").write_text("x")
    log = RunLog(tmp_path, 2)
    clear_run(tmp_path)  # what prepare_run_dir does with --overwrite
    log.step(_record(1), 1)
    log.finish()
    assert "train/loss 7.5 1" in (tmp_path / "tensorboard" / "events.out.tfevents").read_text()
    assert not (tmp_path / "tensorboard" / "old-run").exists()


@pytest.mark.parametrize("steps", ["--validation.steps=0"])
def test_validation_steps_must_be_positive(steps):
    with pytest.raises(ValueError, match="steps = 0 must be >= 1"):
        load_config(None, [steps])
