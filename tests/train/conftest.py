import json

import pytest
import torch.distributed as dist

from shiftlm.config import ModelConfig
from shiftlm.train.setup import EMBEDDED_MODELS


def tied_qwen2_config(directory, num_kv_heads: int = 2) -> str:
    """Write a qwen2 micro model's config.json (q/k/v biases, LM head tied to the embedding, 4 heads
    over `num_kv_heads`) into `directory`; returns its `--model.name=DIR`."""
    config = ModelConfig(
        vocab_size=2048,
        hidden_size=32,
        intermediate_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=num_kv_heads,
        head_dim=8,
        attention_bias=True,
        tie_word_embeddings=True,
        model_type="qwen2",
    )
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict()))
    return f"--model.name={directory}"


def moe_qwen2_config(**changes) -> ModelConfig:
    """The embedded `micro-moe` (train/setup.py): a qwen2_moe micro model, a dense layer 0, 4 experts
    top-2 and a gated shared expert in the others, the load-balancing loss with coefficient 0.1."""
    return ModelConfig(vocab_size=2048, **{**EMBEDDED_MODELS["micro-moe"], **changes})


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    """`--model.name=DIR` of `moe_qwen2_config()` (seeded init)."""
    directory = tmp_path_factory.mktemp("qwen2_moe")
    (directory / "config.json").write_text(json.dumps(moe_qwen2_config().to_hf_dict()))
    return f"--model.name={directory}"


@pytest.fixture(scope="session")
def tied_qwen2_model(tmp_path_factory) -> str:
    """`--model.name=DIR` of a qwen2 micro model (q/k/v biases, GQA, LM head tied to the embedding)."""
    return tied_qwen2_config(tmp_path_factory.mktemp("tied_qwen2"))


def run_training(base: list[str], overrides: list[str], log_dir: str, stop_after: int | None = None):
    """One `shiftlm train` run on this rank (call it through `ranks.run`): its losses by step."""
    from shiftlm.train.config import load_config
    from shiftlm.train.trainer import train

    config = load_config(None, [*base, f"--log.dir={log_dir}", *overrides])
    result = train(config, stop_after=stop_after, quiet=True)
    if dist.is_initialized():
        dist.barrier()
    return result.losses
