from __future__ import annotations

import pytest

from shiftlm.train.config import ConfigError, load_config

PLAN_TOML = """
[model]
name = "micro"
[parallel]
dp = 2
pp = 2
sp = 1
tp = 1
[train]
micro_batch = 1
global_batch = 8
seq_len = 64
schedule = "1f1b"
chunks = 1
recompute = "selective"
zero = 1
"""


def test_the_plan_train_schema_loads_and_overrides_win(tmp_path):
    path = tmp_path / "plan.toml"
    path.write_text(PLAN_TOML)
    config = load_config(path, ["--train.steps=7", "--optim.lr=0.5"])
    assert (config.parallel.dp, config.parallel.pp, config.train.recompute) == (2, 2, "selective")
    assert (config.train.steps, config.optim.lr, config.accumulation) == (7, 0.5, 4)


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        ("--train.stpes=3", "did you mean 'steps'"),
        ("--trian.steps=3", "did you mean 'train'"),
    ],
)
def test_a_typo_gets_a_did_you_mean(override, hint):
    with pytest.raises(ConfigError, match=f"(?i){hint}"):
        load_config(None, [override])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--train.steps=many"], "is not an int"),
        (["--train.recompute=some"], "none, selective, full"),
        (["--parallel.dp=3", "--train.global_batch=8"], "use e.g. global_batch = 9"),
        (["--optim.min_lr=1", "--optim.lr=0.1"], "min_lr <= optim.lr"),
        (["--train.steps=0"], "must be >= 1"),
        (["train.steps"], "--section.key=value"),
    ],
)
def test_bad_values_say_how_to_fix_them(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_toml_value_of_the_wrong_type_is_refused(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[train]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match="train.steps"):
        load_config(path)
