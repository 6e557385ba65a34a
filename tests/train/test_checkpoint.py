"""Kill-and-resume is bit-exact in the same layout, reshards into another, and never reads a torn save."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from shiftlm.model.weights import CheckpointError
from shiftlm.train.checkpoint import latest_checkpoint, read_trainer_state
from shiftlm.train.config import load_config
from shiftlm.train.export import export_checkpoint
from shiftlm.train.trainer import train

STEPS = 6
BASE = [
    "--model.name=micro",
    "--train.seq_len=32",
    "--train.global_batch=4",
    f"--train.steps={STEPS}",
    "--optim.warmup_steps=2",
    "--checkpoint.every=3",
    "--log.progress=off",
]


def run(
    overrides: list[str], log_dir: str, stop_after: int | None = None, resume: bool = False
) -> dict[int, float]:
    config = load_config(None, [*BASE, f"--log.dir={log_dir}", f"--checkpoint.resume={resume}", *overrides])
    return train(config, stop_after=stop_after, quiet=True).losses


@pytest.fixture(scope="module")
def uninterrupted(ranks, tmp_path_factory):
    return ranks.run(1, run, [], str(tmp_path_factory.mktemp("full")))[0]


def test_resume_in_the_same_layout_is_bit_exact(ranks, tmp_path, uninterrupted):
    layout = ["--parallel.dp=2", "--train.micro_batch=1"]
    full = ranks.run(2, run, layout, str(tmp_path / "a"))[0]
    first = ranks.run(2, run, layout, str(tmp_path / "b"), 3)[0]
    rest = ranks.run(2, run, layout, str(tmp_path / "b"), None, True)[0]
    assert list(first) == [1, 2, 3] and list(rest) == [4, 5, 6]
    assert {**first, **rest} == full  # bit-exact, not approximately
    assert full == pytest.approx(uninterrupted, rel=1e-5)


def test_resume_into_another_layout_reshards(ranks, tmp_path, uninterrupted):
    ranks.run(2, run, ["--parallel.tp=2"], str(tmp_path), 3)
    rest = ranks.run(2, run, ["--parallel.pp=2"], str(tmp_path), None, True)[0]
    assert list(rest) == [4, 5, 6]
    for step, loss in rest.items():
        assert loss == pytest.approx(uninterrupted[step], rel=1e-5)


def _cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shiftlm.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        timeout=300,
    )


def test_a_kill_during_a_checkpoint_write_leaves_the_previous_one_and_resume_continues(
    tmp_path, uninterrupted
):
    args = ["train", "--json", *BASE, f"--log.dir={tmp_path}"]
    killed = _cli(args, {"SHIFTLM_CRASH_BEFORE_COMMIT": "6"})
    assert killed.returncode == 17
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_00000003"
    assert list((tmp_path / "checkpoints").glob(".step_00000006.tmp/model/*.safetensors"))  # the torn save
    resumed = _cli(args)
    assert resumed.returncode == 0, resumed.stderr
    losses = {int(k): v for k, v in json.loads(resumed.stdout)["losses"].items()}
    assert losses == {step: uninterrupted[step] for step in (4, 5, 6)}
    assert not list((tmp_path / "checkpoints").glob(".step_*"))  # the next save cleaned it up


def test_a_corrupt_checkpoint_is_named_and_refused(tmp_path):
    (tmp_path / "checkpoints" / "step_00000003").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_00000003" / "trainer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        read_trainer_state(latest_checkpoint(tmp_path / "checkpoints"))
    result = _cli(["train", *BASE, f"--log.dir={tmp_path}"])
    assert result.returncode == 3 and "corrupt" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_export_without_a_checkpoint_fails_and_writes_nothing(tmp_path):
    with pytest.raises(CheckpointError, match="train first"):
        export_checkpoint(tmp_path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("kind", ["missing", "a file"])
def test_export_of_a_checkpoint_that_is_not_a_directory_says_which(tmp_path, kind):
    """A file given as --checkpoint was reported as not existing."""
    source = tmp_path / "step_00000001"
    if kind == "a file":
        source.write_text("")
    words = "is a file, not a checkpoint directory" if kind == "a file" else "does not exist"
    with pytest.raises(CheckpointError, match=words):
        export_checkpoint(tmp_path, tmp_path / "hf", str(source))
    assert not (tmp_path / "hf").exists()


def test_the_exported_model_gives_the_same_logits_in_transformers(ranks, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shiftlm.config import ModelConfig
    from shiftlm.model import build_model

    ranks.run(2, run, ["--parallel.tp=2"], str(tmp_path), 3)
    hf_dir = export_checkpoint(tmp_path, tmp_path / "hf")
    ours = build_model(ModelConfig.from_hf(hf_dir), checkpoint=hf_dir)
    theirs = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    tokens = torch.tensor([AutoTokenizer.from_pretrained(hf_dir)("def main():\n    return 0\n")["input_ids"]])
    with torch.no_grad():
        expected = theirs(tokens).logits
        actual = ours(tokens)[..., : expected.shape[-1]]
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_bitpipe_saves_one_copy_of_each_tensor_and_resumes(ranks, tmp_path, uninterrupted):
    from safetensors import safe_open

    layout = ["--parallel.pp=2", "--train.schedule=bitpipe"]
    ranks.run(2, run, layout, str(tmp_path), 3)
    saved = latest_checkpoint(tmp_path / "checkpoints")
    model_names, moment_names = [], []
    for names, pattern in ((model_names, "model/*.safetensors"), (moment_names, "optimizer-*.safetensors")):
        for file in sorted(saved.glob(pattern)):
            with safe_open(file, framework="pt") as handle:
                names.extend(handle.keys())
    assert len(model_names) == len(set(model_names))  # two replicas trained, one copy written
    assert sorted(moment_names) == sorted(f"{m}.{n}" for m in ("exp_avg", "exp_avg_sq") for n in model_names)
    rest = ranks.run(2, run, layout, str(tmp_path), None, True)[0]
    for step, loss in rest.items():
        assert loss == pytest.approx(uninterrupted[step], rel=1e-5)


def test_the_export_writes_the_generation_config_transformers_writes(ranks, tmp_path):
    """bos/eos/pad as `transformers` reads them, and `generate` on the export says nothing."""
    import logging

    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    ranks.run(1, run, [], str(tmp_path), 3)
    hf_dir = export_checkpoint(tmp_path, tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    generation = GenerationConfig.from_pretrained(hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    assert (generation.bos_token_id, generation.eos_token_id) == (
        config["bos_token_id"],
        config["eos_token_id"],
    )
    assert generation.pad_token_id == tokenizer.pad_token_id is not None
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    hf_logging.get_logger().addHandler(handler)
    try:
        model.generate(**tokenizer("def ", return_tensors="pt"), max_new_tokens=4, do_sample=False)
    finally:
        hf_logging.get_logger().removeHandler(handler)
    assert [r.getMessage() for r in records] == []
