"""Model shapes the simulator needs: presets from published configs, HF config.json, or GPT dims.

Presets copy the published `config.json` of each model (hidden_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, intermediate_size, vocab_size); GPT-3 175B is Brown et al.
2020, Table 2.1, with the GPT-2 vocabulary padded to 51,200 as Megatron does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shiftlm.config import ModelConfig


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape. `gated_mlp` means SwiGLU (three FFN matrices)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    gated_mlp: bool = True
    tied_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        attention = self.hidden * (self.hidden + 2 * self.kv_dim) + self.hidden * self.hidden
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.ffn
        return attention + mlp + 2 * self.hidden  # + the two norms

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        heads = 1 if self.tied_embeddings else 2
        return self.layers * self.layer_params + heads * self.embedding_params


def gpt_style(
    hidden: int,
    layers: int,
    heads: int,
    vocab: int = 51200,
    kv_heads: int | None = None,
    ffn: int | None = None,
    name: str = "gpt",
) -> ModelSpec:
    """GPT dims as in the Megatron tables: 4h GeLU MLP, multi-head attention, tied embeddings."""
    return ModelSpec(
        name=name,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads or heads,
        ffn=ffn or 4 * hidden,
        vocab=vocab,
        gated_mlp=False,
        tied_embeddings=True,
    )


def _llama(name: str, hidden: int, layers: int, heads: int, kv: int, ffn: int, vocab: int) -> ModelSpec:
    return ModelSpec(name, hidden, layers, heads, kv, ffn, vocab)


PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        _llama("llama3-8b", 4096, 32, 32, 8, 14336, 128256),
        _llama("llama3-70b", 8192, 80, 64, 8, 28672, 128256),
        _llama("llama-3.3-70b", 8192, 80, 64, 8, 28672, 128256),
        _llama("llama3-405b", 16384, 126, 128, 8, 53248, 128256),
        _llama("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064),
        _llama("qwen2.5-72b", 8192, 80, 64, 8, 29568, 152064),
        gpt_style(12288, 96, 96, name="gpt3-175b"),
    ]
}


def from_model_config(name: str, model: ModelConfig) -> ModelSpec:
    """The simulator's shape of the engine's own `ModelConfig` (what `shiftlm train` builds)."""
    return ModelSpec(
        name=name,
        hidden=model.hidden_size,
        layers=model.num_layers,
        heads=model.num_heads,
        kv_heads=model.num_kv_heads,
        ffn=model.intermediate_size,
        vocab=model.vocab_size,
        tied_embeddings=model.tie_word_embeddings,
    )


def from_hf_config(path: Path) -> ModelSpec:
    """Read a Hugging Face `config.json` (Llama / Qwen2 / Mistral field names)."""
    try:
        config = json.loads(Path(path).read_text())
        heads = config["num_attention_heads"]
        return ModelSpec(
            name=config.get("_name_or_path") or Path(path).parent.name or "hf-model",
            hidden=config["hidden_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            ffn=config["intermediate_size"],
            vocab=config["vocab_size"],
            gated_mlp=config.get("hidden_act", "silu") in ("silu", "swiglu"),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read model config {path}: {err}") from err
    except KeyError as err:
        raise ValueError(f"{path} lacks {err}; pass an HF decoder config.json or a preset name") from err


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset name (case-insensitive) or a path to a config.json."""
    key = name_or_path.lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.exists():
        return from_hf_config(path)
    raise ValueError(
        f"unknown model {name_or_path!r}: give a preset ({', '.join(PRESETS)}) or a path to config.json"
    )
