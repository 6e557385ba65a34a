import json

import pytest

from shiftlm.config import ModelConfig


@pytest.fixture(scope="session")
def tied_qwen2_model(tmp_path_factory) -> str:
    """`--model.name=DIR` of a qwen2 micro model (q/k/v biases, GQA, LM head tied to the embedding)."""
    config = ModelConfig(
        vocab_size=2048,
        hidden_size=32,
        intermediate_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        attention_bias=True,
        tie_word_embeddings=True,
        model_type="qwen2",
    )
    directory = tmp_path_factory.mktemp("tied_qwen2")
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict()))
    return f"--model.name={directory}"
