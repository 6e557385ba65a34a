"""Rotary position embeddings (Su et al. 2021), with Llama-3 frequency scaling.

Frequencies and angles are computed in fp32 exactly as `transformers` does, so logits match it.
"""

from __future__ import annotations

import math

import torch

from shiftlm.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between smoothed
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [..., head_dim] for integer `positions` of any shape."""
    freqs = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., tokens, heads, head_dim]; cos/sin: [..., tokens, head_dim] (or [..., tokens, 1, head_dim])."""
    if cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + _rotate_half(x) * sin


def apply_rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rope` of q and of k ([..., tokens, heads, head_dim]); in one pass over both when k's
    heads follow q's in memory (the outputs of one fused QKV GEMM), with the same values.
    `kernels`: serving's CPU kernels (kernels/cpu.py), which have a one-pass RoPE; None: PyTorch's."""
    heads, dim = q.shape[-2], q.shape[-1]
    adjacent = (
        q.shape[:-2] == k.shape[:-2]
        and all(size == 1 or a == b for size, a, b in zip(q.shape[:-2], q.stride(), k.stride()))
        and q.stride()[-2:] == k.stride()[-2:] == (dim, 1)
        and k.data_ptr() == q.data_ptr() + heads * dim * q.element_size()
    )
    if not adjacent:
        return _rope(q, cos, sin, kernels), _rope(k, cos, sin, kernels)
    both = _rope(q.as_strided((*q.shape[:-2], heads + k.shape[-2], dim), q.stride()), cos, sin, kernels)
    return both[..., :heads, :], both[..., heads:, :]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ops=None) -> torch.Tensor:
    """`apply_rope`, by the CPU kernel `ops` where given (one pass; 512 tokens x 10 heads 44 us
    against eager's 166, `python bench/serve_kernels.py`) and the layout fits: tokens [1, T, H, D] or
    [T, H, D] with heads contiguous, cos/sin one row per token, fp32 on the CPU."""
    if (
        ops is None
        or x.device.type != "cpu"
        or x.dtype != torch.float32
        or not hasattr(ops, "rope")
        or x.requires_grad
        or x.dim() not in (3, 4)
    ):
        return apply_rope(x, cos, sin)
    tokens, dim = x.shape[-3], x.shape[-1]
    rows = x[0] if x.dim() == 4 and x.shape[0] == 1 else x
    if rows.dim() != 3 or rows.stride()[1:] != (dim, 1) or cos.numel() != tokens * dim:
        return apply_rope(x, cos, sin)
    out = ops.rope(rows, cos.reshape(tokens, dim), sin.reshape(tokens, dim))
    return out.view(x.shape)
