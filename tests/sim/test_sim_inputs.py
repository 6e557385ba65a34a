"""The simulator refuses layouts the model cannot be cut into, never predicts MFU above 100%,
counts mode switches only where two modes exist, and prints strict JSON (issue 10, item 6)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftlm.cli import main
from shiftlm.hardware import CATALOG, Hardware
from shiftlm.presets import PRESETS, gpt_style
from shiftlm.sim import jsonout
from shiftlm.sim.efficiency import FITTED, Efficiency, measured
from shiftlm.sim.layout import Layout
from shiftlm.sim.train import simulate_step


def _run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_tp_that_does_not_divide_the_heads_is_one_line_naming_valid_values(capsys):
    code, out, err = _run(
        ["simulate", "train", "--model", "llama3-70b", "--gpu", "h100", "--gpus", "64", "--tp", "3"], capsys
    )
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "num_attention_heads = 64" in err and "use sp*tp in [1, 2, 4, 8, 16, 32, 64]" in err


def test_sp_times_tp_that_breaks_the_kv_heads_is_refused(capsys):
    # llama3-8b: 32 heads, 8 KV heads; tp x sp = 16 is fine (16 % 8 == 0), but gpt dims with 12
    # heads and 4 KV heads cannot take tp x sp = 8 (12 % 8) nor 6 (6 and 4 do not divide each other)
    code, _, err = _run(
        ["simulate", "train", "--hidden", "768", "--layers", "4", "--heads", "12", "--kv-heads", "4"]
        + ["--gpus", "6", "--tp", "6"],
        capsys,
    )
    assert code == 2 and "KV heads" in err and err.count("\n") == 1


def test_more_pipeline_stages_than_layers_is_refused(capsys):
    code, _, err = _run(
        ["simulate", "train", "--hidden", "256", "--layers", "4", "--heads", "4", "--gpus", "8", "--pp", "8"],
        capsys,
    )
    assert code == 2 and "4 layers" in err


def _calibrated_cpu() -> Hardware:
    # the shape of a `shiftlm calibrate` profile: a median scalar peak and shaped GEMM rates, some faster
    table = tuple(
        (role, m, k, n, rate)
        for role in ("forward", "dgrad", "wgrad")
        for (m, k, n), rate in (
            ((16, 256, 256), 40e9),
            ((128, 1024, 1024), 107e9),
            ((512, 1024, 4096), 143e9),
        )
    )
    return Hardware(
        "this",
        {"fp32": 107e9, "bf16": 107e9},
        16e9,
        20e9,
        5e9,
        5e9,
        2,
        gemm_table=table,
        extra={"op_overhead": 1e-6},
    )


@settings(max_examples=25, deadline=None)
@given(
    hidden=st.sampled_from([256, 1024, 4096]),
    seq=st.sampled_from([512, 2048, 8192, 32768]),
    micro_batch=st.sampled_from([1, 4]),
    tp=st.sampled_from([1, 2]),
    recompute=st.sampled_from(["none", "selective", "full"]),
    calibrated=st.booleans(),
)
def test_mfu_is_never_above_100_percent(hidden, seq, micro_batch, tp, recompute, calibrated):
    # tiny hidden with long sequences is where counting the full s x s attention (the PaLM convention)
    # against causal FlashAttention kernels, or a profile's fastest GEMM above its median peak, broke it
    model = gpt_style(hidden, 4, 4, vocab=32000)
    hardware = _calibrated_cpu() if calibrated else CATALOG["h100-sxm"]
    efficiency = measured(hardware.extra) if calibrated else FITTED
    layout = Layout(
        dp=1, pp=1, tp=tp, micro_batch=micro_batch, global_batch=micro_batch, seq_len=seq, recompute=recompute
    )
    result = simulate_step(model, layout, hardware, efficiency, "fp32" if calibrated else "bf16")
    assert 0 < result.mfu <= 1


def test_an_efficiency_above_the_peak_is_refused():
    with pytest.raises(ValueError, match=r"gemm = 1.2 must lie in \(0, 1\]"):
        Efficiency(gemm=1.2)


def test_serve_with_sp_1_has_no_mode_switches(capsys):
    # --mode shift with tp = gpus leaves sp = 1: both "modes" are the same 8-way TP step
    code, out, _ = _run(
        ["simulate", "serve", "--model", "llama-3.3-70b", "--gpu", "h100", "--gpus", "8", "--mode", "shift"]
        + ["--tp", "8", "--trace", "azure_code", "--max-requests", "60", "--json"],
        capsys,
    )
    summary = json.loads(out)
    assert code == 0 and summary["mode_switches"] == 0 and summary["steps_per_mode"]["sp_tp"] == 0


def test_serve_shift_with_sp_above_1_does_switch(capsys):
    code, out, _ = _run(
        ["simulate", "serve", "--model", "llama-3.3-70b", "--gpu", "h100", "--gpus", "8", "--mode", "shift"]
        + ["--tp", "4", "--trace", "azure_code", "--max-requests", "60", "--json"],
        capsys,
    )
    assert code == 0 and json.loads(out)["mode_switches"] > 0


def test_serve_tp_that_does_not_divide_the_heads_is_refused(capsys):
    code, _, err = _run(
        ["simulate", "serve", "--model", "llama-3.3-70b", "--gpu", "h100", "--gpus", "6", "--mode", "tp"]
        + ["--trace", "azure_code", "--max-requests", "5"],
        capsys,
    )
    assert code == 2 and "use sp*tp in [1, 2, 4, 8, 16, 32, 64]" in err and err.count("\n") == 1


SERVE = ["--model", "llama3-8b", "--gpu", "h100", "--trace", "azure_code", "--max-requests", "5"]
PLAN_TRAIN = ["plan", "train", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--seq", "4096"]


@pytest.mark.parametrize(
    "argv,words",
    [
        (["simulate", "serve", *SERVE, "--gpus", "0", "--mode", "tp"], "--gpus 0 must be >= 1"),
        (["plan", "serve", *SERVE, "--gpus", "0"], "--gpus 0 must be >= 1"),
        (["plan", "serve", *SERVE, "--gpus", "8", "--max-num-seqs", "0"], "--max-num-seqs 0 must be >= 1"),
        (["simulate", "serve", *SERVE, "--gpus", "8", "--mode", "tp", "--tp", "-2"], "--tp -2 must be >= 1"),
        ([*PLAN_TRAIN, "--global-batch", "0"], "--global-batch 0 must be >= 1"),
    ],
    ids=[
        "simulate-serve-gpus",
        "plan-serve-gpus",
        "plan-serve-seqs",
        "simulate-serve-tp",
        "plan-global-batch",
    ],
)
def test_counts_below_one_are_one_line_naming_the_flag(argv, words, capsys, tmp_path, monkeypatch):
    """--gpus 0 was "math domain error" (simulate serve, plan serve); plan train --global-batch 0
    planned a 0.01 s step and wrote its train.toml."""
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and words in err, err
    assert not list(tmp_path.iterdir())  # nothing written


def test_calibrate_refuses_an_out_it_cannot_write_before_measuring(tmp_path, capsys, monkeypatch):
    """`calibrate --out a-file/x.json` measured for a minute, then printed a FileExistsError traceback."""
    import shiftlm.sim.calibrate as measuring

    monkeypatch.setattr(measuring, "calibrate", lambda **_: pytest.fail("measured before checking --out"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, _, err = _run(["calibrate", "--out", str(blocker / "x.json")], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"--out's directory {blocker} cannot be written (it is a file)" in err


def _strict(text: str):
    def refuse(constant: str):
        raise AssertionError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def test_plan_serve_json_is_strict(capsys):
    # the best layout can be pure TP, whose shift threshold is infinite: it is written as null
    code, out, _ = _run(
        ["plan", "serve", "--model", "llama-3.3-70b", "--gpu", "h100", "--gpus", "8", "--trace", "azure_code"]
        + ["--max-requests", "40", "--thresholds", "256", "--json"],
        capsys,
    )
    assert code == 0
    _strict(out)


def test_strict_json_writes_null_for_non_finite_numbers():
    text = jsonout.dumps({"a": math.inf, "b": [math.nan, 1.5], "c": (-math.inf,)})
    assert _strict(text) == {"a": None, "b": [None, 1.5], "c": [None]}


def test_calibrate_names_the_exact_flag(monkeypatch, tmp_path, capsys):
    import shiftlm.sim.calibrate as calibrate_module

    fake = _calibrated_cpu()
    monkeypatch.setattr(calibrate_module, "calibrate", lambda log=print: fake)
    out = tmp_path / "hw.json"
    assert main(["calibrate", "--out", str(out)]) == 0
    flag = f"--gpu this --hardware {out}"
    assert flag in capsys.readouterr().out
    # and the flag works
    code, text, _ = _run(
        ["simulate", "train", *flag.split(), "--gpus", "2", "--hidden", "256", "--layers", "2"]
        + ["--heads", "4", "--tp", "2", "--seq", "128", "--dtype", "fp32", "--json"],
        capsys,
    )
    assert code == 0 and json.loads(text)["gpu"] == "this"


def test_llama3_8b_presets_still_simulate():
    result = simulate_step(
        PRESETS["llama3-8b"], Layout(dp=1, pp=1, tp=8, seq_len=8192), CATALOG["h100-sxm"], FITTED
    )
    assert 0 < result.mfu < 1
