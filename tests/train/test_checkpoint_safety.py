"""Checkpoints are data, not code, are durable before they are visible, and never mix two runs or
shift the data of a resumed one (issue 13, item 6); a run says where it resumed and what it left."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from shiftlm.cli import main
from shiftlm.errors import CheckpointError
from shiftlm.train import checkpoint
from shiftlm.train.checkpoint import load_rng, rng_tensors, set_rng_tensors

RUN = ["--model.name=micro", "--train.seq_len=32", "--train.global_batch=2", "--log.progress=off"]


def _train(capsys, run_dir: Path, *extra: str) -> tuple[int, str, str]:
    code = main(["train", *RUN, f"--log.dir={run_dir}", *extra])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A 2-step run with its checkpoint (copied by each test that changes it)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", *RUN, f"--log.dir={run_dir}", "--train.steps=2", "--json"]) == 0
    return run_dir


@pytest.fixture
def run_dir(finished_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


class _Payload:
    """Unpickling this writes a marker file: what a malicious checkpoint would do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pwned"))


def test_a_malicious_rng_pickle_in_a_checkpoint_is_not_executed(capsys, run_dir, tmp_path):
    marker = tmp_path / "pwned"
    rng = run_dir / "checkpoints" / "step_00000002" / "rng"
    torch.save({"torch": _Payload(str(marker))}, rng / "rank-00000.pt")
    # the payload is live: the old loader (weights_only=False) would have run it
    torch.load(rng / "rank-00000.pt", weights_only=False)
    assert marker.exists()
    marker.unlink()

    # beside the tensors file it is ignored; resuming restores the RNG from safetensors
    code, out, err = _train(capsys, run_dir, "--train.steps=3")
    assert code == 0, err
    assert "resumed from step 2" in out and not marker.exists()

    # alone (an older checkpoint's layout) it is refused, not unpickled
    (rng / "rank-00000.safetensors").unlink()
    with pytest.raises(CheckpointError, match="refused to unpickle"):
        load_rng(rng.parent, 0)
    assert not marker.exists()


def test_a_refused_pickle_is_one_line_with_the_checkpoint_exit_code(capsys, run_dir, tmp_path):
    marker = tmp_path / "pwned"
    rng = run_dir / "checkpoints" / "step_00000002" / "rng"
    (rng / "rank-00000.safetensors").unlink()
    torch.save({"torch": _Payload(str(marker))}, rng / "rank-00000.pt")
    code, out, err = _train(capsys, run_dir, "--train.steps=3")
    assert code == 3 and not marker.exists()
    assert len(err.strip().splitlines()) == 1 and "refused to unpickle" in err and "Traceback" not in err


def test_rng_states_round_trip_through_tensors():
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    np.random.standard_normal(), random.gauss(0, 1)  # leave cached gaussians in both generators
    saved = rng_tensors()
    expected = (torch.rand(3), np.random.standard_normal(3), [random.gauss(0, 1) for _ in range(3)])
    torch.rand(7), np.random.rand(5), random.random()
    set_rng_tensors(saved)
    again = (torch.rand(3), np.random.standard_normal(3), [random.gauss(0, 1) for _ in range(3)])
    assert torch.equal(expected[0], again[0])
    assert np.array_equal(expected[1], again[1]) and expected[2] == again[2]


def test_every_file_and_directory_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    staging = tmp_path / "checkpoints" / ".step_00000005.tmp"
    (staging / "model").mkdir(parents=True)
    (staging / "model" / "model.safetensors").write_bytes(b"weights")
    (staging / "optimizer-00000.safetensors").write_bytes(b"moments")
    events: list[tuple[str, str]] = []
    real_open, real_fsync, real_replace = os.open, os.fsync, os.replace
    opened: dict[int, str] = {}

    def recording_open(path, *args, **kwargs):
        fd = real_open(path, *args, **kwargs)
        opened[fd] = str(path)
        return fd

    def recording_fsync(fd):
        events.append(("fsync", opened.get(fd, "?")))
        real_fsync(fd)

    def recording_replace(src, dst):
        events.append(("rename", str(src)))
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "open", recording_open)
    monkeypatch.setattr(checkpoint.os, "fsync", recording_fsync)
    monkeypatch.setattr(checkpoint.os, "replace", recording_replace)
    final = checkpoint.commit(staging, {"step": 5}, keep=2)

    rename = events.index(("rename", str(staging)))
    synced = [path for kind, path in events[:rename] if kind == "fsync"]
    files = [staging / "model" / "model.safetensors", staging / "optimizer-00000.safetensors"]
    for path in [*files, staging / "trainer.json"]:
        assert str(path) in synced
    for directory in (staging / "model", staging):  # directories after the files they hold
        assert synced.index(str(directory)) > max(synced.index(str(f)) for f in files)
    assert events[rename + 1] == ("fsync", str(final.parent))  # the rename itself made durable
    assert json.loads((final / "trainer.json").read_text()) == {"step": 5}


def test_a_fresh_start_into_a_used_run_dir_is_refused_unless_overwrite(capsys, run_dir):
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    code, out, err = _train(capsys, run_dir, "--train.steps=2", "--checkpoint.resume=false")
    assert code == 6 and len(err.strip().splitlines()) == 1
    assert "holds another run" in err and "--overwrite" in err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before  # nothing touched

    code, out, err = _train(capsys, run_dir, "--train.steps=1", "--overwrite")
    assert code == 0, err
    # the old run is gone: only this run's checkpoint and one metrics line remain
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000001"]
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("--train.seq_len=16", "train.seq_len=32 (now 16)"),
        ("--train.global_batch=4", "train.global_batch=2 (now 4)"),
        ("--data.corpus_mb=2", "data.corpus_mb=4.0 (now 2.0)"),
    ],
)
def test_resuming_with_changed_data_shaping_is_refused_with_the_fix(capsys, run_dir, change, named):
    code, out, err = _train(capsys, run_dir, "--train.steps=3", change)
    assert code == 6 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert named in err and "would shift the data" in err
    assert not (run_dir / "checkpoints" / "step_00000003").exists()


def test_a_changed_dataset_under_the_same_name_is_refused(capsys, run_dir):
    state_file = run_dir / "checkpoints" / "step_00000002" / "trainer.json"
    state = json.loads(state_file.read_text())
    state["dataset_samples"] += 1  # as if the files behind data.source had changed
    state_file.write_text(json.dumps(state))
    code, out, err = _train(capsys, run_dir, "--train.steps=3")
    assert code == 6 and "the data source changed" in err


def test_a_finished_run_says_so_and_where_its_outputs_are(capsys, run_dir):
    code, out, err = _train(capsys, run_dir, "--train.steps=2")
    assert code == 0, err
    assert "run already complete at step 2" in out
    for path in ("checkpoints/step_00000002", "metrics.jsonl", "loss.png"):
        assert str(run_dir / path) in out
    assert "step 1/" not in out  # nothing retrained


def test_a_run_with_checkpoints_off_saves_nothing_and_never_mixes_runs(capsys, tmp_path):
    """`checkpoint.enable = false` (a benchmark run: torchtitan's switch): no checkpoint at the last step
    or a timed one, a rerun into the same log.dir is a fresh start refused without --overwrite (it cannot
    resume), and asking for periodic checkpoints as well is one line."""
    run_dir = tmp_path / "bench"
    off = ["--checkpoint.enable=false", "--checkpoint.every_s=0.001"]
    code, out, err = _train(capsys, run_dir, "--train.steps=2", *off)
    assert code == 0, err
    assert not any((run_dir / "checkpoints").glob("step_*")) and "checkpoint  none" in out
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2

    code, out, err = _train(capsys, run_dir, "--train.steps=3", *off)
    assert code == 6 and len(err.strip().splitlines()) == 1
    assert "checkpoint.enable is false" in err and "--overwrite" in err and "--checkpoint.resume" not in err
    code, out, err = _train(capsys, run_dir, "--train.steps=3", "--overwrite", *off)
    assert code == 0, err
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3  # this run's steps only

    code, out, err = _train(capsys, tmp_path / "other", "--checkpoint.enable=false", "--checkpoint.every=5")
    assert code == 2 and "checkpoint.every = 5" in err and "drop one" in err
    code, out, err = _train(capsys, tmp_path / "other", "--checkpoint.enable=false", "--max-restarts=2")
    assert code == 2 and "--max-restarts resumes from the newest checkpoint" in err and "drop one" in err


def test_a_stop_or_failure_without_checkpoints_names_no_checkpoint_to_resume(run_dir):
    """A run dir holding an old checkpoint: a run with checkpoints off would not resume it, so neither
    the signal's line nor a failed rank's hint offers it."""
    import signal

    from shiftlm.train.cli import interrupted_line
    from shiftlm.train.config import load_config
    from shiftlm.train.elastic import resume_hint

    config = load_config(None, [*RUN, f"--log.dir={run_dir}", "--checkpoint.enable=false"])
    line = interrupted_line(signal.SIGTERM, config, None)
    assert line == "SIGTERM: stopped without a checkpoint (checkpoint.enable is false)"
    assert "step_00000002" not in resume_hint(config) and "checkpoint.enable is false" in resume_hint(config)
