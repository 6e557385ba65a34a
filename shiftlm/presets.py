"""Model shapes the simulator reads: `ModelConfig`s from presets, an HF config.json, or GPT dims.

Presets copy the published `config.json` of each model (hidden_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, intermediate_size, vocab_size); GPT-3 175B is Brown et al.
2020, Table 2.1, with the GPT-2 vocabulary padded to 51,200 as Megatron does. The mixtures of
experts are read from the keys of their published `config.json` (mistralai/Mixtral-8x7B-v0.1,
Qwen/Qwen3-235B-A22B) as a checkpoint's config is.
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
        ModelConfig.from_hf_dict(
            {
                "_name_or_path": "mixtral-8x7b",
                "model_type": "mixtral",
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "vocab_size": 32000,
                "num_local_experts": 8,
                "num_experts_per_tok": 2,
                "max_position_embeddings": 32768,
                "rope_theta": 1e6,
                "sliding_window": None,
            }
        ),
        ModelConfig.from_hf_dict(
            {
                "_name_or_path": "qwen3-235b-a22b",
                "model_type": "qwen3_moe",
                "hidden_size": 4096,
                "intermediate_size": 12288,
                "moe_intermediate_size": 1536,
                "num_hidden_layers": 94,
                "num_attention_heads": 64,
                "num_key_value_heads": 4,
                "head_dim": 128,
                "vocab_size": 151936,
                "num_experts": 128,
                "num_experts_per_tok": 8,
                "norm_topk_prob": True,
                "max_position_embeddings": 40960,
                "rope_theta": 1e6,
            }
        ),
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
