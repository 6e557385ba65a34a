"""Training on multi-stream samples (data.format = "streams"): dp, tp and pp give the single-rank losses
(1e-5, fp32), the model learns, and Ulysses / ring layouts are refused with one line."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from shiftlm.errors import ConfigError
from shiftlm.train.config import load_config
from shiftlm.train.trainer import train

STEPS = 4
WORDS = "the cat sat on a mat while two dogs ran past the old red barn and a bird sang".split()


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> str:
    """Samples of 2 or 3 streams with different lengths: counting, and words read forwards/backwards."""
    path = tmp_path_factory.mktemp("streams-data") / "streams.jsonl"
    lines = []
    for i in range(16):
        words = WORDS[i % 5 :][:6]
        streams = [" ".join(words), " ".join(reversed(words)), " ".join(str(n) for n in range(i, i + 4))]
        lines.append(json.dumps({"prefix": f"sample {i}: read", "streams": streams[: 2 + i % 2]}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def base(source: str) -> list[str]:
    return [
        "--model.name=micro",
        "--data.format=streams",
        f"--data.source={source}",
        "--train.seq_len=48",
        "--train.global_batch=4",
        "--train.micro_batch=1",
        f"--train.steps={STEPS}",
        "--optim.warmup_steps=1",
        "--checkpoint.resume=false",
        "--log.progress=off",
        "--validation.freq=0",
    ]


def train_losses(overrides: list[str], log_dir: str) -> dict[int, float]:
    config = load_config(None, [*overrides, f"--log.dir={log_dir}"])
    result = train(config, quiet=True)
    if dist.is_initialized():
        dist.barrier()
    return result.losses


@pytest.fixture(scope="module")
def single_rank_losses(ranks, samples, tmp_path_factory):
    return ranks.run(1, train_losses, base(samples), str(tmp_path_factory.mktemp("one")))[0]


LAYOUTS = {
    "dp2": ["--parallel.dp=2", "--train.micro_batch=2"],
    "tp2": ["--parallel.tp=2"],
    "pp2_1f1b": ["--parallel.pp=2", "--train.schedule=1f1b"],
    "pp2_bitpipe": ["--parallel.pp=2", "--train.schedule=bitpipe"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_layout_matches_the_single_rank_losses(ranks, samples, tmp_path, single_rank_losses, layout):
    losses = ranks.run(2, train_losses, base(samples) + LAYOUTS[layout], str(tmp_path))[0]
    assert list(losses) == list(range(1, STEPS + 1))
    for step, reference in single_rank_losses.items():
        assert losses[step] == pytest.approx(reference, rel=1e-5), f"step {step}"
    assert single_rank_losses[STEPS] < single_rank_losses[1]


@pytest.mark.parametrize("flag", ["--parallel.sp=2", "--parallel.cp=2"])
def test_ulysses_and_ring_layouts_are_refused_with_one_line(samples, flag):
    from shiftlm.train.setup import model_shape

    config = load_config(None, base(samples) + [flag])
    with pytest.raises(ConfigError, match="data.format = 'streams' trains with dp, tp and pp only"):
        model_shape(config)
