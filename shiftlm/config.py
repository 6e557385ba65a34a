"""The model's configuration (read from and written to a Hugging Face `config.json`); the parallel
layout is `shiftlm/parallel.py`.

A value that cannot work is a `ConfigError` (shiftlm/errors.py) whose message names the fix.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from shiftlm.errors import CheckpointError, ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "mixtral", "qwen2_moe", "qwen3_moe")
# mixture-of-experts families (docs/moe.md): routed SwiGLU experts in place of (some) MLPs
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
# silu: SwiGLU, what the engine runs; gelu: the plain 4h MLP of GPT shapes, which only the simulator
# reads (the Megatron tables it is validated on)
HIDDEN_ACTS = ("silu", "gelu")
# What the trainer implements, read by it and by the simulator and planners (which may not import train/)
RECOMPUTE_MODES = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)  # the ZeRO stages the trainer implements (a stage that lands is added here)
LOSS_CHUNK = 1024  # tokens per chunk of the LM head + cross-entropy (train.loss_chunk's default)


def compiles_by_default(device_type: str) -> bool:
    """`train.compile = auto`: compiled decoder blocks on CUDA (where they pay), eager on the CPU
    (where compiling a model costs more than a short run gains). Read by the trainer
    (`model/compile.wants_compile`) and by `shiftlm simulate|plan train`'s default mode."""
    return device_type == "cuda"


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_scaling` with `rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only Llama-family transformer (llama, qwen2, mistral): the one model shape, read by
    the model, the trainer, the server and the simulator (whose presets are `ModelConfig`s)."""

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 176
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    attention_bias: bool = False  # qwen2: biases on q/k/v projections
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # mistral
    initializer_range: float = 0.02
    model_type: str = "llama"
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    hidden_act: str = "silu"
    # mixture of experts (num_experts 0: a dense model); see docs/moe.md
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # one expert's FFN width
    shared_expert_intermediate_size: int = 0  # qwen2_moe: a dense expert every token takes, sigmoid-gated
    norm_topk_prob: bool = True  # renormalise the top-k probabilities to sum to 1 (mixtral always does)
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 and i is not in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0  # the load-balancing loss's weight in the training loss
    output_router_logits: bool = False  # transformers adds the load-balancing loss to the loss when set
    qk_norm: bool = False  # qwen3: RMSNorm over each query and key head before RoPE
    name: str = field(default="", compare=False)  # a label for reports (a preset or checkpoint name)
    # the checkpoint's own `_name_or_path` ("" where config.json has none): vLLM's default served name
    name_or_path: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported; shiftlm runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (supported: silu)")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok = {self.num_experts_per_tok} must be between 1 and num_experts = "
                f"{self.num_experts}: set the router's top-k to at most the number of experts"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` routes to experts (transformers' rule for qwen2_moe; every layer else)."""
        return (
            self.is_moe and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )

    @cached_property  # the planner asks ~10^6 times a search (a frozen config: it cannot change)
    def moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def gated_mlp(self) -> bool:
        """SwiGLU: three FFN matrices (gate, up, down) instead of two."""
        return self.hidden_act == "silu"

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one layer's GEMMs (q, k, v, o and the MLP): what FLOPs are counted from. For a
        mixture of experts, the weights one token meets (router, its top-k experts, the shared expert),
        averaged over the layers (qwen2_moe may keep dense MLPs in some)."""
        h, attention_width = self.hidden_size, self.num_heads * self.head_dim
        return h * (2 * attention_width + 2 * self.kv_dim) + self._ffn_params(active=True)

    def _ffn_params(self, active: bool) -> int:
        """The FFN weights of a layer, averaged over layers: every expert's (`active` False) or the
        top-k's a token uses (`active` True)."""
        h, matrices = self.hidden_size, 3 if self.gated_mlp else 2
        dense = matrices * h * self.intermediate_size
        if not self.is_moe:
            return dense
        experts = self.num_experts_per_tok if active else self.num_experts
        shared = matrices * h * self.shared_expert_intermediate_size + (
            h if self.shared_expert_intermediate_size else 0
        )
        moe = experts * matrices * h * self.moe_intermediate_size + self.num_experts * h + shared
        sparse = self.moe_layers
        return (sparse * moe + (self.num_layers - sparse) * dense) // self.num_layers

    @property
    def layer_params(self) -> int:
        """One layer's parameters: its GEMM weights, qwen2's q/k/v biases and the two norms."""
        bias = self.num_heads * self.head_dim + 2 * self.kv_dim if self.attention_bias else 0
        qk_norm = 2 * self.head_dim if self.qk_norm else 0
        attention = self.layer_matmul_params - self._ffn_params(active=True)
        return attention + self._ffn_params(active=False) + bias + qk_norm + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        embeddings = self.embedding_params * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * self.layer_params + embeddings + self.hidden_size

    def flops_per_token(self, seq_len: int, causal: bool = False) -> float:
        """Training FLOPs (forward + backward, no recompute) per token: 6 N + 12 L d S, PaLM's MFU
        convention (Chowdhery et al. 2022, App. B; nanoGPT's `estimate_mfu`), the one formula
        behind the trainer's MFU and the simulator's. N counts the GEMM weights of every layer and
        the LM head, which runs its matmul whether or not it is tied to the input embedding (the
        embedding itself is a lookup); d = heads x head_dim. `causal` counts only the lower triangle
        of the S x S attention (what FlashAttention and the trainer's causal SDPA execute; Dao 2023),
        so that MFU never exceeds the hardware FLOPs utilisation."""
        matmul = self.num_layers * self.layer_matmul_params + self.embedding_params
        attention = (6 if causal else 12) * self.num_layers * self.num_heads * self.head_dim * seq_len
        return 6 * matmul + attention

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unknown model_type {model_type!r} in config.json; shiftlm runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints"
            )
        heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
        rope_theta = raw.get("rope_theta")
        rope_scaling = None
        if isinstance(scaling, dict):
            rope_theta = rope_theta or scaling.get("rope_theta")
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "llama3":
                rope_scaling = RopeScaling(
                    factor=float(scaling["factor"]),
                    low_freq_factor=float(scaling["low_freq_factor"]),
                    high_freq_factor=float(scaling["high_freq_factor"]),
                    original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                )
            elif kind != "default":
                raise ConfigError(f"rope_scaling type {kind!r} is not supported (supported: default, llama3)")
        if raw.get("hidden_act", "silu") not in ("silu", "swiglu"):
            raise ConfigError(
                f"hidden_act {raw['hidden_act']!r} in config.json: shiftlm runs SwiGLU (silu) models"
            )
        sliding = raw.get("sliding_window")
        if model_type in ("qwen2", "qwen2_moe", "qwen3_moe") and not raw.get("use_sliding_window", False):
            sliding = None
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            attention_bias=bool(
                raw.get("qkv_bias", raw.get("attention_bias", model_type in ("qwen2", "qwen2_moe")))
            ),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_window=sliding,
            initializer_range=raw.get("initializer_range", 0.02),
            model_type=model_type,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            name=raw.get("_name_or_path") or "",
            name_or_path=raw["_name_or_path"].strip() if isinstance(raw.get("_name_or_path"), str) else "",
            **_moe_fields(model_type, raw),
        )

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` from a checkpoint directory (or the file itself)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.exists():
            raise CheckpointError(
                f"no config.json at {file}: point --model at a Hugging Face checkpoint directory"
            )
        try:
            raw = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(
                f"{file} is not valid JSON ({err}): restore it from the original checkpoint"
            ) from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{file} holds a {type(raw).__name__}, not a JSON object: restore it")
        try:
            config = cls.from_hf_dict(raw)
            return config if config.name else replace(config, name=file.parent.name)
        except KeyError as err:
            raise CheckpointError(
                f"{file} lacks the key {err.args[0]!r}: it is not a Llama-family config.json"
            ) from None
        except (TypeError, ValueError) as err:
            if isinstance(err, ConfigError):
                raise
            raise CheckpointError(f"{file} has a value of the wrong type ({err}): restore it") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` that `transformers` reads back into the same model."""
        architectures = {
            "llama": "LlamaForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "mistral": "MistralForCausalLM",
            "mixtral": "MixtralForCausalLM",
            "qwen2_moe": "Qwen2MoeForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM",
        }
        raw: dict[str, Any] = {
            "architectures": [architectures[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
        }
        if self.rope_scaling is not None:
            raw["rope_scaling"] = {"rope_type": "llama3", **asdict(self.rope_scaling)}
        if self.model_type == "llama":
            raw["attention_bias"] = self.attention_bias
            raw["mlp_bias"] = False
        if self.model_type in ("mistral", "mixtral"):
            raw["sliding_window"] = self.sliding_window
        if self.model_type in ("qwen2", "qwen2_moe", "qwen3_moe"):
            raw["use_sliding_window"] = False
        if self.is_moe:
            raw.update(
                num_experts_per_tok=self.num_experts_per_tok,
                router_aux_loss_coef=self.router_aux_loss_coef,
                output_router_logits=self.output_router_logits,
            )
        if self.model_type == "mixtral":
            raw["num_local_experts"] = self.num_experts
        elif self.model_type in ("qwen2_moe", "qwen3_moe"):
            raw.update(
                num_experts=self.num_experts,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                attention_bias=self.attention_bias,
            )
            if self.model_type == "qwen2_moe":
                raw["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
                raw["qkv_bias"] = self.attention_bias
        return raw


def _moe_fields(model_type: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a `config.json` (none for the dense families)."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    fields: dict[str, Any] = dict(
        num_experts=int(raw.get("num_experts") or raw.get("num_local_experts") or 0),
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        router_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.001)),
        output_router_logits=bool(raw.get("output_router_logits", False)),
    )
    if raw.get("router_jitter_noise") or raw.get("router_z_loss_coef"):
        raise ConfigError(
            f"{model_type} config.json asks for router jitter or a z-loss, which shiftlm does not implement: "
            "set router_jitter_noise / router_z_loss_coef to 0"
        )
    if (
        model_type == "mixtral"
    ):  # every layer sparse, experts as wide as intermediate_size, top-k renormalised
        return {**fields, "moe_intermediate_size": raw["intermediate_size"], "norm_topk_prob": True}
    return {
        **fields,
        "moe_intermediate_size": int(raw["moe_intermediate_size"]),
        "shared_expert_intermediate_size": int(raw.get("shared_expert_intermediate_size") or 0),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
        "decoder_sparse_step": int(raw.get("decoder_sparse_step") or 1),
        "mlp_only_layers": tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        "qk_norm": model_type == "qwen3_moe",
    }


def ceil_to_multiple(value: int, multiple: int) -> int:
    return int(math.ceil(value / multiple) * multiple)
