"""The tensor-parallel plan as a table: how each Hugging Face tensor is cut into TP shards.

A `ShardSpec` says which rows (or columns) of the full tensor a rank holds: a list of index ranges
along one dimension, then zero padding (vocab padded to a multiple of TP). Every layer, the
checkpoint loader and the saver read the same spec, so a layout can never load one way and save
another.

GQA (docs/design.md "GQA"): with KV heads >= the number of head blocks, block b holds KV heads
[b*KV/blocks, (b+1)*KV/blocks); with fewer KV heads than blocks, block b holds the single KV head
floor(b*KV/blocks), replicated across the blocks that share it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shiftlm.config import ModelConfig, ceil_to_multiple


@dataclass(frozen=True)
class ShardSpec:
    """Rows `ranges` of dimension `dim` of the full tensor, then `pad` zero rows (dim None: the whole tensor)."""

    dim: int | None
    ranges: tuple[tuple[int, int], ...] = ()
    pad: int = 0

    @property
    def length(self) -> int:
        return sum(b - a for a, b in self.ranges) + self.pad


def kv_heads_of_block(block: int, num_blocks: int, num_kv_heads: int) -> tuple[int, int]:
    """The KV heads [first, last) that query-head block `block` of `num_blocks` attends with."""
    if num_kv_heads >= num_blocks:
        per = num_kv_heads // num_blocks
        return block * per, (block + 1) * per
    head = block * num_kv_heads // num_blocks
    return head, head + 1


def padded_vocab(config: ModelConfig, tp: int) -> int:
    return ceil_to_multiple(config.vocab_size, tp)


_LAYER = re.compile(r"model\.layers\.\d+\.")


def shard_spec(name: str, config: ModelConfig, tp_rank: int, tp_size: int) -> ShardSpec:
    """The TP plan: HF tensor name -> this rank's slice of it."""
    key = _LAYER.sub("", name)
    d = config.head_dim
    if key in ("model.embed_tokens.weight", "lm_head.weight"):
        per = padded_vocab(config, tp_size) // tp_size
        start = tp_rank * per
        stop = min(start + per, config.vocab_size)
        real = max(stop - start, 0)
        return ShardSpec(0, ((start, start + real),) if real else (), per - real)
    if key.startswith("self_attn.q_proj."):
        per = config.num_heads // tp_size * d
        return ShardSpec(0, ((tp_rank * per, (tp_rank + 1) * per),))
    if key.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
        first, last = kv_heads_of_block(tp_rank, tp_size, config.num_kv_heads)
        return ShardSpec(0, ((first * d, last * d),))
    if key == "self_attn.o_proj.weight":
        per = config.num_heads // tp_size * d
        return ShardSpec(1, ((tp_rank * per, (tp_rank + 1) * per),))
    if key in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        per = config.intermediate_size // tp_size
        return ShardSpec(0, ((tp_rank * per, (tp_rank + 1) * per),))
    if key == "mlp.down_proj.weight":
        per = config.intermediate_size // tp_size
        return ShardSpec(1, ((tp_rank * per, (tp_rank + 1) * per),))
    if key in ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight"):
        return ShardSpec(None)
    raise KeyError(f"no tensor-parallel rule for {name!r}")


def full_shape(name: str, config: ModelConfig) -> tuple[int, ...]:
    """The shape of tensor `name` in a Hugging Face checkpoint of this model."""
    key = _LAYER.sub("", name)
    h, d, f = config.hidden_size, config.head_dim, config.intermediate_size
    shapes = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "lm_head.weight": (config.vocab_size, h),
        "self_attn.q_proj.weight": (config.num_heads * d, h),
        "self_attn.k_proj.weight": (config.num_kv_heads * d, h),
        "self_attn.v_proj.weight": (config.num_kv_heads * d, h),
        "self_attn.q_proj.bias": (config.num_heads * d,),
        "self_attn.k_proj.bias": (config.num_kv_heads * d,),
        "self_attn.v_proj.bias": (config.num_kv_heads * d,),
        "self_attn.o_proj.weight": (h, config.num_heads * d),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "model.norm.weight": (h,),
    }
    return shapes[key]
