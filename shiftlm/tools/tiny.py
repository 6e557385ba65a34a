"""Tiny real Hugging Face checkpoints (random weights) for tests, `shiftlm verify` and demos.

Sized so that every layout up to sp*tp = 8 applies: 8 query heads, a vocabulary that no TP degree
divides (to exercise vocab padding), an FFN width divisible by 8.
"""

from __future__ import annotations

from pathlib import Path

TINY_FAMILIES = ("llama", "llama-gqa", "qwen2", "mistral", "mixtral", "qwen2-moe", "qwen3-moe")
MOE_FAMILIES = ("mixtral", "qwen2-moe", "qwen3-moe")


def make_tiny_checkpoint(
    path: str | Path, family: str = "llama-gqa", seed: int = 0, num_heads: int = 8, vocab_size: int = 250
) -> Path:
    """Write a tiny `family` checkpoint with `transformers` `save_pretrained` and return its path.

    llama: MHA (8 KV heads); llama-gqa: 2 KV heads with Llama-3 rope scaling; qwen2: 2 KV heads and
    q/k/v biases, tied embeddings; mistral: 2 KV heads and a sliding window shorter than the test sequence.
    The mixtures of experts have 8 experts, top-2: mixtral (two experts with the same router row in
    layer 0, so every token's choice is a tie that `torch.topk` resolves); qwen2-moe (a dense layer 0
    by `mlp_only_layers`, a sigmoid-gated shared expert, top-k not renormalised); qwen3-moe (q/k norms,
    top-k renormalised, the load-balancing loss in the training loss with coefficient 0.1).
    `num_heads`: 8 query heads of 8 (the default), or e.g. 4 of 16, which FlexAttention's CUDA
    kernels need (`serve/worker/flex_decode.MIN_CUDA_HEAD_DIM`). `vocab_size`: 250, or more for a
    real byte-level tokenizer (256 bytes + specials + merges: tests/serve/test_structured.py).
    """
    import torch
    import transformers as tf

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
    )
    if family == "llama":
        config = tf.LlamaConfig(num_key_value_heads=8, **common)
        cls = tf.LlamaForCausalLM
    elif family == "llama-gqa":
        config = tf.LlamaConfig(
            num_key_value_heads=2,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            **common,
        )
        cls = tf.LlamaForCausalLM
    elif family == "qwen2":
        config = tf.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common)
        cls = tf.Qwen2ForCausalLM
    elif family == "mistral":
        config = tf.MistralConfig(num_key_value_heads=2, sliding_window=6, **common)
        cls = tf.MistralForCausalLM
    elif family == "mixtral":
        config = tf.MixtralConfig(
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=2,
            **{**common, "intermediate_size": 32},
        )
        cls = tf.MixtralForCausalLM
    elif family == "qwen2-moe":
        config = tf.Qwen2MoeConfig(
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[0],
            norm_topk_prob=False,
            **common,
        )
        cls = tf.Qwen2MoeForCausalLM
    elif family == "qwen3-moe":
        config = tf.Qwen3MoeConfig(
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            output_router_logits=True,
            router_aux_loss_coef=0.1,
            **common,
        )
        cls = tf.Qwen3MoeForCausalLM
    else:
        raise ValueError(f"unknown tiny family {family!r}; choose one of {', '.join(TINY_FAMILIES)}")
    torch.manual_seed(seed)
    model = cls(config).float()
    with torch.no_grad():  # non-trivial norm weights, biases and routers, so a mix-up cannot hide
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
            if name.endswith(
                ("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight")
            ):
                param.normal_(0.0, 0.5)
        if family == "mixtral":  # experts 2 and 5 of layer 0 tie for every token
            gate = model.model.layers[0].mlp.gate.weight
            gate[5] = gate[2]
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    return path
