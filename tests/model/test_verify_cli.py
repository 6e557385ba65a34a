import json
import subprocess
import sys


def _verify(*args):
    return subprocess.run(
        [sys.executable, "-m", "shiftlm.cli", "verify", *args], capture_output=True, text=True, timeout=300
    )


def test_verify_reports_every_layout_as_json(tiny_checkpoints):
    result = _verify("--model", tiny_checkpoints["qwen2"], "--tp", "2", "--sp", "1,2", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["passed"] is True
    assert [(r["tp"], r["sp"]) for r in report["layouts"]] == [(2, 1), (2, 2)]
    for row in report["layouts"]:
        assert row["logits_max_rel"] <= 1e-5 and row["embedding_grad_max_rel"] <= 1e-5


def test_verify_rejects_an_impossible_layout_with_the_fix(tiny_checkpoints):
    result = _verify("--model", tiny_checkpoints["llama"], "--tp", "3")
    assert result.returncode == 2
    assert "sp*tp = 3 must divide num_attention_heads = 8" in result.stderr
    assert "Traceback" not in result.stderr


def test_verify_fails_loudly_on_a_tolerance_it_cannot_meet(tiny_checkpoints):
    result = _verify("--model", tiny_checkpoints["llama"], "--tp", "2", "--tolerance", "0", "--json")
    assert result.returncode == 1
    assert json.loads(result.stdout)["passed"] is False


def test_verify_in_bf16_autocast_is_judged_against_transformers_own_bf16_error(tiny_checkpoints):
    """`--dtype bfloat16` (training's GPU precision; CPU autocast here): both shiftlm and transformers are
    compared with transformers in fp32, and shiftlm's error may be at most --bf16-slack times theirs."""
    result = _verify("--model", tiny_checkpoints["llama"], "--tp", "1,2", "--dtype", "bfloat16", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["passed"] is True and report["dtype"] == "bfloat16"
    for row in report["layouts"]:
        assert 1e-4 < row["logits_max_rel"] <= 2 * row["transformers_bf16_logits_max_rel"]  # bf16, not fp32
    tight = _verify(
        "--model", tiny_checkpoints["llama"], "--tp", "1", "--dtype", "bfloat16", "--bf16-slack", "0.1"
    )
    assert tight.returncode == 1
