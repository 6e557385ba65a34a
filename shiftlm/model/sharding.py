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
_EXPERT = re.compile(r"experts\.\d+\.")
# (gate, up, down) of an expert: the Qwen families use the MLP's names, Mixtral w1, w3, w2
_EXPERT_ROLE = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
}
_FFN = ("mlp.", "block_sparse_moe.")


def _key(name: str) -> str:
    """A tensor's name without its layer (and expert) index."""
    return _EXPERT.sub("experts.", _LAYER.sub("", name))


def is_expert_param(name: str) -> bool:
    """A routed expert's weight: held by one ep rank, its gradient summed over the `edp` group."""
    return ".experts." in name


def tp_partial_grad(name: str) -> bool:
    """Replicated over TP, but each TP rank's gradient is a partial sum: the router and shared-expert
    gate (each rank sees its share of the experts' outputs) and Qwen3's per-head q/k norms (each rank
    normalises its own heads). `grads.sync_tp_replicated_grads` sums them over TP."""
    return _key(name) in (
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate.weight",
        "block_sparse_moe.gate.weight",
        "mlp.shared_expert_gate.weight",
    )


def _ffn_part(key: str) -> tuple[str, str] | None:
    """("expert" | "shared_expert", "gate" | "up" | "down") for an MoE projection's key, else None."""
    for prefix in _FFN:
        for part in ("experts.", "shared_expert."):
            head = prefix + part
            if key.startswith(head) and key.endswith(".weight"):
                role = _EXPERT_ROLE.get(key[len(head) : -len(".weight")])
                if role is not None:
                    return part.rstrip("."), role
    return None


def shard_spec(name: str, config: ModelConfig, tp_rank: int, tp_size: int) -> ShardSpec:
    """The TP plan: HF tensor name -> this rank's slice of it."""
    key = _key(name)
    d = config.head_dim
    moe = _ffn_part(key)
    if moe is not None:  # expert TP = TP: an expert splits like the dense MLP
        part, role = moe
        width = config.moe_intermediate_size if part == "experts" else config.shared_expert_intermediate_size
        per = width // tp_size
        return ShardSpec(0 if role != "down" else 1, ((tp_rank * per, (tp_rank + 1) * per),))
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
    if tp_partial_grad(name):
        return ShardSpec(None)
    raise KeyError(f"no tensor-parallel rule for {name!r}")


def full_shape(name: str, config: ModelConfig) -> tuple[int, ...]:
    """The shape of tensor `name` in a Hugging Face checkpoint of this model."""
    key = _key(name)
    h, d, f = config.hidden_size, config.head_dim, config.intermediate_size
    moe = _ffn_part(key)
    if moe is not None:
        part, role = moe
        width = config.moe_intermediate_size if part == "experts" else config.shared_expert_intermediate_size
        return (h, width) if role == "down" else (width, h)
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
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "mlp.gate.weight": (config.num_experts, h),
        "block_sparse_moe.gate.weight": (config.num_experts, h),
        "mlp.shared_expert_gate.weight": (1, h),
    }
    return shapes[key]
