"""Every user error through the real `shiftlm` command: one line on stderr naming the fix, no traceback,
and the documented exit code (shiftlm.errors.EXIT_CODES)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shiftlm.cli import main
from shiftlm.errors import EXIT_CODES

USAGE, CHECKPOINT, DATA = 2, 3, 4
MICRO = ["--train.seq_len=32", "--train.global_batch=2", "--log.progress=off"]


def _run(capsys, argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


def _assert_one_line(err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize(
    ("argv", "code", "fragments"),
    [
        (["train", "--train.stpes=3"], USAGE, ["--train.stpes=3", "did you mean --train.steps?"]),
        (["train", "--trian.steps=3"], USAGE, ["did you mean --train.steps?"]),
        (["train", "--nproc", "0"], USAGE, ["--nproc", "must be >= 1"]),
        (["train", "--nproc=-2"], USAGE, ["--nproc", "must be >= 1"]),
        (["trian"], USAGE, ["unknown command 'trian'", "did you mean 'train'?"]),
        (["train", "--train.steps=many"], USAGE, ["train.steps", "is not an int"]),
        (["train", "--train.zero=7"], USAGE, ["train.zero = 7"]),
        (["train", "--parallel.dp=2"], USAGE, ["needs 2 ranks", "--nproc 2"]),
        (["train", "--parallel.tp=3"], USAGE, ["sp*tp = 3 must divide num_attention_heads = 4"]),
        (["train", "--parallel.pp=8"], USAGE, ["pp = 8 is more than the model's 4 layers"]),
        (["train", "--parallel.dp=2", "--nproc", "4"], USAGE, ["needs 2 ranks", "--nproc is 4"]),
        (["train", "missing.toml"], USAGE, ["config file missing.toml does not exist"]),
        (["train", "--data.source=/no/such/dir"], DATA, ["data.source", "does not exist"]),
        (["export", "--run", "/no/such/run", "--to-hf", "out"], CHECKPOINT, ["no checkpoint", "train first"]),
    ],
)
def test_a_bad_command_line_is_one_line_with_its_exit_code(capsys, tmp_path, argv, code, fragments):
    if argv[0] == "train":
        argv = [*argv, "--model.name=micro", *MICRO, f"--log.dir={tmp_path / 'run'}"]
    got, err = _run(capsys, argv)
    assert got == code, err
    _assert_one_line(err, *fragments)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_an_invalid_toml_file_names_the_file(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3\n")
    code, err = _run(capsys, ["train", str(bad)])
    assert code == USAGE
    _assert_one_line(err, f"{bad} is not valid TOML")


def test_a_toml_key_typo_gets_a_did_you_mean(capsys, tmp_path):
    bad = tmp_path / "typo.toml"
    bad.write_text("[train]\nstpes = 3\n")
    code, err = _run(capsys, ["train", str(bad)])
    assert code == USAGE
    _assert_one_line(err, "train.stpes", "Did you mean 'steps'?")


def test_a_config_json_that_is_not_json_is_a_checkpoint_error(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{this is not json")
    run = f"--log.dir={tmp_path / 'run'}"
    for argv in (["train", f"--model.name={tmp_path}", *MICRO, run], ["verify", "--model", str(tmp_path)]):
        code, err = _run(capsys, argv)
        assert code == CHECKPOINT
        _assert_one_line(err, "config.json is not valid JSON", "restore it")


def test_a_truncated_safetensors_is_a_checkpoint_error(capsys, tmp_path):
    from shiftlm.tools.tiny import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "model", "llama")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code, err = _run(capsys, ["verify", "--model", str(model), "--tp", "1"])
    assert code == CHECKPOINT
    _assert_one_line(err, "model.safetensors is truncated or corrupt", "export the checkpoint again")


def test_a_positional_config_file_trains(capsys, tmp_path):
    config = tmp_path / "small.toml"
    config.write_text(
        '[model]\nname = "micro"\n[train]\nseq_len = 32\nglobal_batch = 2\nsteps = 2\n'
        f'[log]\ndir = "{tmp_path / "run"}"\nprogress = "off"\n'
    )
    code = main(["train", str(config), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    summary = json.loads(out)
    assert summary["steps"] == 2 and summary["checkpoint"].endswith("step_00000002")


def test_two_different_config_files_are_refused(capsys, tmp_path):
    code, err = _run(capsys, ["train", "a.toml", "--config", "b.toml"])
    assert code == USAGE
    _assert_one_line(err, "two config files given")


def test_help_and_version_do_not_import_torch():
    script = (
        "import sys, contextlib, io\n"
        "from shiftlm.cli import main\n"
        "for argv in (['--help'], ['--version']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit as exit:\n"
        "            assert exit.code == 0, exit.code\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_the_command_describes_itself_its_commands_and_its_exit_codes():
    result = subprocess.run(
        [sys.executable, "-m", "shiftlm", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0
    for command in ("quickstart", "train", "export", "verify", "serve", "simulate", "plan", "monitor"):
        assert f"    {command}" in result.stdout
    for code in EXIT_CODES:
        assert f"{code:>3}  " in result.stdout
    version = subprocess.run([sys.executable, "-m", "shiftlm", "--version"], capture_output=True, text=True)
    assert version.stdout.startswith("shiftlm ") and version.returncode == 0


def test_subcommand_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    out = capsys.readouterr().out
    assert "(default: runs/train)" in out
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--train.steps INT" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["monitor", "schedule", "quickstart", "export"])
def test_every_command_help_opens_with_what_it_does(capsys, command):
    from shiftlm.cli import COMMANDS

    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert out.split("\n\n")[1].strip(), out  # the paragraph after the usage line
    if command == "monitor":
        assert COMMANDS["monitor"].help in out
