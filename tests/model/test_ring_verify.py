"""`shiftlm verify --cp` checks context-parallel layouts against Hugging Face, and refuses bad ones
with one line naming the fix."""

import json
import subprocess
import sys


def _verify(*args):
    return subprocess.run(
        [sys.executable, "-m", "shiftlm.cli", "verify", *args], capture_output=True, text=True, timeout=600
    )


def test_verify_checks_cp_and_cp_x_sp_layouts_against_hf(tiny_checkpoints):
    result = _verify(
        "--model", tiny_checkpoints["llama-gqa"], "--cp", "1,2", "--sp", "1,2", "--seq-len", "24", "--json"
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["passed"] is True
    assert [(r["cp"], r["sp"], r["ranks"]) for r in report["layouts"]] == [
        (1, 1, 1),
        (1, 2, 2),
        (2, 1, 2),
        (2, 2, 4),
    ]
    for row in report["layouts"]:
        assert row["logits_max_rel"] <= 1e-5 and row["embedding_grad_max_rel"] <= 1e-5


def test_verify_refuses_a_sequence_the_zigzag_split_cannot_cut(tiny_checkpoints):
    result = _verify("--model", tiny_checkpoints["llama"], "--cp", "2", "--seq-len", "18")
    assert result.returncode == 2
    assert "sequence length 18 must split into 2*cp*sp = 4 equal chunks" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_verify_refuses_cp_on_a_sliding_window_model(tiny_checkpoints):
    result = _verify("--model", tiny_checkpoints["mistral"], "--cp", "2")
    assert result.returncode == 2
    assert "does not support sliding-window attention" in result.stderr and "use cp = 1" in result.stderr
    assert "Traceback" not in result.stderr
