"""Bad inputs give one clear line on stderr, exit code 2, no traceback and no files."""

from __future__ import annotations

import pytest

from shiftlm.cli import main


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--train.stpes=3"], "unrecognized arguments: --train.stpes=3"),
        (["--parallel.tp=3"], "sp*tp = 3 must divide num_attention_heads = 4"),
        (["--parallel.dp=2"], "needs 2 ranks but the world has 1"),
        (["--parallel.pp=8"], "pp = 8 is more than the model's 4 layers"),
        (["--data.source=EMPTY"], "no data files"),
    ],
)
def test_bad_training_input_is_one_clear_line(tmp_path, capsys, args, message):
    (tmp_path / "empty").mkdir()
    args = [a.replace("EMPTY", str(tmp_path / "empty")) for a in args]
    with pytest.raises(SystemExit) if "unrecognized" in message else _no_raise():
        code = main(["train", "--model.name=micro", f"--log.dir={tmp_path / 'run'}", *args])
        assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
