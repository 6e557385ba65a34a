"""How many KV-cache blocks a rank holds: `--num-blocks` as given, or, on a GPU, what
`--gpu-memory-utilization` of its memory leaves after the weights and a step's activations (as vLLM
sizes its cache). Every rank of a shift group holds the same number (the smallest any rank can).

    per_block = kv_bytes_per_block(config, parallel, block_size=16, dtype_bytes=2)
    blocks = blocks_for_memory(free, total, 0.9, activation_bytes(...), per_block)
"""

from __future__ import annotations

from shiftlm.config import ModelConfig
from shiftlm.errors import ConfigError
from shiftlm.model.sharding import kv_heads_of_block
from shiftlm.parallel import ParallelConfig

CPU_BLOCKS = 256  # --num-blocks on the CPU when not given: 4,096 tokens of 16 per rank


def kv_heads_per_rank(config: ModelConfig, parallel: ParallelConfig) -> int:
    """KV heads each rank caches: its block of P = sp*tp (`sharding.kv_heads_of_block`, as the runner
    sizes its cache)."""
    first, last = kv_heads_of_block(0, parallel.shift_size, config.num_kv_heads)
    return last - first


def kv_bytes_per_block(
    config: ModelConfig, parallel: ParallelConfig, block_size: int, dtype_bytes: int
) -> int:
    """Bytes of one block (K and V, every layer) on one rank."""
    per_token = 2 * config.num_layers * kv_heads_per_rank(config, parallel) * config.head_dim
    return per_token * block_size * dtype_bytes


def activation_bytes(
    config: ModelConfig, parallel: ParallelConfig, max_tokens: int, max_seqs: int, dtype_bytes: int
) -> int:
    """A bound on one step's transient memory on a rank: a layer's activations for `max_tokens`
    tokens (the residual and norm, the attention projections, the MLP's gate/up/product on this rank's
    share of the width), live one layer at a time, plus fp32 logits for `max_seqs` sampled rows."""
    p = parallel.shift_size
    width = 6 * config.hidden_size + 3 * config.intermediate_size // p
    return max_tokens * width * dtype_bytes + max_seqs * config.vocab_size * 4 * 2


def blocks_for_memory(
    free: int, total: int, utilization: float, activations: int, per_block: int, weights: int = 0
) -> int:
    """Blocks that fit in `utilization` x `total` once what is in use now (`total - free`, the weights
    included when they are loaded), `weights` still to load and `activations` are taken out."""
    budget = utilization * total - (total - free) - weights - activations
    return max(int(budget // per_block), 0)


def check_capacity(num_blocks: int, block_size: int, max_model_len: int | None, sized_by: str) -> None:
    """The cache must hold at least one sequence of --max-model-len (or of one block), else one line
    naming the flags; `sized_by` says what sized it."""
    tokens = num_blocks * block_size
    need = max_model_len or block_size
    if tokens < need:
        raise ConfigError(
            f"the KV cache holds {tokens} tokens per rank ({sized_by}), less than one sequence of "
            f"{need} (--max-model-len): lower --max-model-len, raise --gpu-memory-utilization, or use "
            "more ranks (--tp/--sp)"
        )
