"""Model shapes the simulator reads: `ModelConfig`s from presets, an HF config.json, or GPT dims.

Presets copy the published `config.json` of each model (hidden_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, intermediate_size, vocab_size); GPT-3 175B is Brown et al.
2020, Table 2.1, with the GPT-2 vocabulary padded to 51,200 as Megatron does.
"""

from __future__ import annotations

from pathlib import Path

from shiftlm.config import ModelConfig


def gpt_style(
    hidden: int,
    layers: int,
    heads: int,
    vocab: int = 51200,
    kv_heads: int | None = None,
    ffn: int | None = None,
    name: str = "gpt",
) -> ModelConfig:
    """GPT dims as in the Megatron tables: 4h GeLU MLP, multi-head attention, tied embeddings."""
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn or 4 * hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads or heads,
        head_dim=hidden // heads,
        tie_word_embeddings=True,
        hidden_act="gelu",
        name=name,
    )


def _preset(name: str, hidden: int, layers: int, heads: int, kv: int, ffn: int, vocab: int) -> ModelConfig:
    qwen = name.startswith("qwen")
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=hidden // heads,
        attention_bias=qwen,
        model_type="qwen2" if qwen else "llama",
        name=name,
    )


PRESETS: dict[str, ModelConfig] = {
    model.name: model
    for model in [
        _preset("llama3-8b", 4096, 32, 32, 8, 14336, 128256),
        _preset("llama3-70b", 8192, 80, 64, 8, 28672, 128256),
        _preset("llama-3.3-70b", 8192, 80, 64, 8, 28672, 128256),
        _preset("llama3-405b", 16384, 126, 128, 8, 53248, 128256),
        _preset("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064),
        _preset("qwen2.5-72b", 8192, 80, 64, 8, 29568, 152064),
        gpt_style(12288, 96, 96, name="gpt3-175b"),
    ]
}


def _normal(name: str) -> str:
    """A preset name without case, '-' and '_': llama-3-70b, Llama3-70B and llama3_70b are one."""
    return "".join(c for c in name.lower() if c not in "-_ ")


def resolve_model(name_or_path: str) -> ModelConfig:
    """A preset name (case, '-' and '_' ignored) or a path to a config.json (or its checkpoint dir)."""
    key = _normal(name_or_path)
    for name, model in PRESETS.items():
        if _normal(name) == key:
            return model
    if Path(name_or_path).exists():
        return ModelConfig.from_hf(name_or_path)
    raise ValueError(
        f"unknown model {name_or_path!r}: give a preset ({', '.join(PRESETS)}) or a path to config.json"
    )
