"""From a `TrainConfig` to the things a run needs: the model config, tokenizer, token shards, layout.

The embedded default is a tiny Llama (`tiny`) sized to train in minutes on two CPU cores with the
stdlib tokenizer's vocabulary. `[model] name` may also be a path to an HF config.json or checkpoint
dir (a dir with weights starts from them), or a simulator preset such as `llama3-8b` (shape only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from shiftlm.config import ModelConfig
from shiftlm.errors import ConfigError
from shiftlm.parallel import ParallelConfig
from shiftlm.train.config import TrainConfig
from shiftlm.train.deterministic import check_deterministic
from shiftlm.train.moe import aux_loss_active
from shiftlm.train.pipeline import resolved_chunks
from shiftlm.train.sources import prepare_shards
from shiftlm.train.streams import check_data_format
from shiftlm.train.tokenizer import embedded_tokenizer, read_tokenizer_json

EMBEDDED_MODELS = {
    # 4 layers x 128 wide: ~1.3M parameters with a 2048-token vocabulary
    "tiny": dict(
        hidden_size=128, intermediate_size=352, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32
    ),
    # the parity tests' model: small enough for 20 steps on 4 ranks in seconds
    "micro": dict(
        hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8
    ),
    # micro as a Qwen2-MoE: a dense layer 0, then 4 experts top-2 and a gated shared expert, the
    # load-balancing loss in the training loss (`--model.name=micro-moe --parallel.ep=2`)
    "micro-moe": dict(
        hidden_size=32,
        intermediate_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        model_type="qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        mlp_only_layers=(0,),
        norm_topk_prob=False,
        router_aux_loss_coef=0.1,
        output_router_logits=True,
    ),  # fmt: skip
}


@dataclass(frozen=True)
class RunInputs:
    model: ModelConfig
    init_checkpoint: Path | None  # HF weights to start from; None: seeded init
    tokenizer_dir: Path
    shards: list[Path]


def _on_local_leader_first(build) -> None:
    """Run `build` on one process per machine while the others wait; re-raise its error on every rank."""
    error = None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        try:
            build()
        except Exception as err:  # noqa: BLE001 - passed to every rank below
            error = err
    if dist.is_available() and dist.is_initialized():
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, None if error is None else (type(error), str(error)))
        raised = next((e for e in errors if e is not None), None)
        if raised is not None:
            raise raised[0](raised[1])
    elif error is not None:
        raise error


def model_config(name: str, vocab_size: int, eos_token_id: int) -> tuple[ModelConfig, Path | None]:
    """The model `model.name` names (an embedded model, an HF checkpoint or config, a preset) and the
    checkpoint to initialise from, if it has weights."""
    if name in EMBEDDED_MODELS:
        return ModelConfig(
            vocab_size=vocab_size,
            bos_token_id=eos_token_id,
            eos_token_id=eos_token_id,
            max_position_embeddings=4096,
            **EMBEDDED_MODELS[name],
        ), None
    path = Path(name)
    if path.exists():
        config = ModelConfig.from_hf(path)
        has_weights = path.is_dir() and any(path.glob("model*.safetensors"))
        return config, (path if has_weights else None)
    from shiftlm.presets import PRESETS

    if name.lower() in PRESETS:
        return PRESETS[name.lower()], None
    known = ", ".join([*EMBEDDED_MODELS, *PRESETS])
    raise ConfigError(
        f"model.name {name!r} is neither a preset ({known}) nor an existing path to an HF config"
    )


def check_layout(config: TrainConfig, model: ModelConfig, world_size: int) -> ParallelConfig:
    """The layout as the core's ParallelConfig, after every check that needs the model."""
    parallel = config.parallel
    # before the world size: a layout that cannot fit the model is the news
    parallel.check_model(model, resolved_chunks(config))
    if config.data.format == "streams" and parallel.pp > 1 and aux_loss_active(model):
        raise ConfigError(  # the router statistics travel with the activations; stream stages do not carry them
            "data.format = 'streams' with the MoE load-balancing loss (output_router_logits) needs pp = 1: "
            "set parallel.pp = 1, or output_router_logits false in config.json"
        )
    parallel.check_world_size(world_size)
    parallel.check_sequence(config.train.seq_len)
    check_data_format(config)
    if config.train.deterministic:
        check_deterministic(parallel, config.train.zero)
    return parallel


def model_shape(config: TrainConfig) -> ModelConfig:
    """The model's shape before any rank starts (the embedded models take data.vocab_size, which the
    embedded tokenizer has); checks the layout against it, so a bad layout fails in the first second."""
    model, _ = model_config(config.model.name, config.data.vocab_size, 0)
    check_layout(config, model, config.parallel.world_size)
    return model


def resolve_inputs(config: TrainConfig) -> RunInputs:
    """Tokenizer, model config and token shards; built on one process per machine, read by all."""
    data = config.data
    corpus_bytes = int(data.corpus_mb * 1_000_000)

    def build() -> tuple[Path, list[Path]]:
        tokenizer_dir = (
            Path(data.tokenizer) if data.tokenizer else embedded_tokenizer(data.vocab_size, corpus_bytes)
        )
        if data.format == "streams":  # train/streams.py reads the JSONL itself
            return tokenizer_dir, []
        return tokenizer_dir, prepare_shards(data.source, str(tokenizer_dir), data.text_key, corpus_bytes)

    _on_local_leader_first(build)
    tokenizer_dir, shards = build()  # the others now find everything in the cache
    tokenizer = read_tokenizer_json(tokenizer_dir)
    eos = tokenizer.token_to_id("<|endoftext|>")
    model, init = model_config(config.model.name, tokenizer.get_vocab_size(), eos if eos is not None else 0)
    if tokenizer.get_vocab_size() > model.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.get_vocab_size()} tokens but the model only {model.vocab_size}: "
            "use a matching data.tokenizer"
        )
    return RunInputs(model, init, tokenizer_dir, shards)
