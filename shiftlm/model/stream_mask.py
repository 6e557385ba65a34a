"""Who sees whom in a stream group: the one function that builds the attention mask (and, for
hogwild, the query rotation) of K parallel streams over a shared prompt. Serving (the paged cache,
`serve/engine/streams.py`) and training on multi-stream samples (`train/streams.py`) both call it, so the
model is trained with exactly the visibility it is served with.

Every token carries a tag `(stream, position)`: prompt tokens have stream `PROMPT` (-1) and their
index as position; token t of stream k has position `prompt_len + t` (its timestep), whatever the
layout. K/V are written once with that position and never re-rotated.

- `isolated`: a stream sees the prompt and its own tokens up to itself (n-way sampling).
- `timestep` (Multi-Stream LLMs): token t of every stream sees the prompt, every stream's tokens at
  timesteps < t, and itself.
- `hogwild` (Hogwild! Inference, Rodionov et al. 2025, the contiguous layout): the same tokens as
  `timestep`, but each viewer i lays the cache out as prompt, then the other workers' tokens, each
  worker contiguous and in worker order, then its own tokens last, with positions counted along
  that view. Since RoPE scores depend only on query minus key position, the keys stay where they
  were written and the viewer's query is rotated by a per-key-block `shift` instead
  (the paper's query rotation): effective query position = position + shift[q, key].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LAYOUTS = ("isolated", "timestep", "hogwild")
NORMAL, ISOLATED, TIMESTEP, HOGWILD = 0, 1, 2, 3  # layout codes (0: an ordinary causal sequence)
PROMPT = -1  # stream id of the shared prompt's tokens


def layout_code(name: str) -> int:
    if name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; choose one of {', '.join(LAYOUTS)}")
    return LAYOUTS.index(name) + 1


def interleave(prompt_len: int, stream_lengths: list[int]) -> tuple[list[int], list[int]]:
    """Tags (stream, position) of a group in cache order: the prompt, then for each timestep t the
    token t of every stream that has one, in stream order (the order serving writes them)."""
    streams, positions = [PROMPT] * prompt_len, list(range(prompt_len))
    for t in range(max(stream_lengths, default=0)):
        for k, length in enumerate(stream_lengths):
            if t < length:
                streams.append(k)
                positions.append(prompt_len + t)
    return streams, positions


def stream_visibility(
    layout: int,
    q_stream: torch.Tensor,
    q_pos: torch.Tensor,
    k_stream: torch.Tensor,
    k_pos: torch.Tensor,
    k_valid: torch.Tensor | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Queries [..., Q] and keys [..., C] tagged (stream, position) -> (mask [..., Q, C], True where
    the query reads the key; shift [..., Q, C] for hogwild, else None). `k_valid` drops key slots;
    `window` (a sliding-window model's; isolated streams only) keeps keys less than it behind the
    query by position, so each stream attends exactly as the one sequence of its own tokens would."""
    if window is not None and layout != ISOLATED:
        raise ValueError("a sliding window is defined for isolated streams only")
    qs, qp = q_stream.unsqueeze(-1), q_pos.unsqueeze(-1)
    ks, kp = k_stream.unsqueeze(-2), k_pos.unsqueeze(-2)
    not_later = kp <= qp
    mask = not_later & ((ks == PROMPT) | (ks == qs))  # the prompt causally, own stream up to itself
    if layout != ISOLATED:
        mask |= (ks != PROMPT) & (qs != PROMPT) & (kp < qp)  # every stream's earlier timesteps
    if window is not None:
        mask &= qp - kp < window
    if k_valid is not None:
        mask &= k_valid.unsqueeze(-2)
    shift = _hogwild_shift(mask, q_stream, k_stream) if layout == HOGWILD else None
    return mask, shift


def _hogwild_shift(mask: torch.Tensor, q_stream: torch.Tensor, k_stream: torch.Tensor) -> torch.Tensor:
    """Viewer (i, t) sees n_j visible tokens of each worker j; in its view worker j (j != i) starts at
    offset sum(n_j' for j' < j, j' != i) past the prompt and its own tokens at sum(n_j, j != i).
    shift = own offset - offset of the key's block (0 for own keys, own offset for prompt keys)."""
    workers = int(k_stream.max()) + 1 if k_stream.numel() else 0
    if workers <= 0:
        return torch.zeros(mask.shape, dtype=torch.long, device=mask.device)
    key_is_stream = k_stream != PROMPT
    onehot = F.one_hot(k_stream.clamp(min=0), workers) * key_is_stream.unsqueeze(-1)  # [..., C, W]
    counts = torch.matmul(mask.double(), onehot.double()).round().long()  # [..., Q, W] visible per worker
    own = F.one_hot(q_stream.clamp(min=0), workers).bool() & (q_stream != PROMPT).unsqueeze(-1)
    others = counts.masked_fill(own, 0)
    offsets = torch.cumsum(others, -1) - others  # [..., Q, W] where worker j starts in the view
    own_offset = others.sum(-1, keepdim=True)  # [..., Q, 1]
    index = k_stream.clamp(min=0).unsqueeze(-2).expand(mask.shape)
    key_offset = torch.gather(offsets, -1, index)
    key_offset = torch.where(k_stream.unsqueeze(-2) == q_stream.unsqueeze(-1), own_offset, key_offset)
    key_offset = torch.where(key_is_stream.unsqueeze(-2), key_offset, 0)
    shift = own_offset - key_offset
    return torch.where((q_stream != PROMPT).unsqueeze(-1), shift, 0)


def sample_visibility(
    layout: str, prompt_len: int, stream_lengths: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A whole group in cache order (training, tests): (streams [T], positions [T], mask [T, T])."""
    streams, positions = interleave(prompt_len, stream_lengths)
    s, p = torch.tensor(streams, dtype=torch.long), torch.tensor(positions, dtype=torch.long)
    mask, _ = stream_visibility(layout_code(layout), s, p, s, p)
    return s, p, mask


class MaskedAttention:
    """A dense attention backend (`attention.AttentionBackend`) with an explicit mask [B, S, S]: the
    training forward of multi-stream samples (train/streams.py), the mask from `stream_visibility`."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask.unsqueeze(1)  # [B, 1, S, S], broadcast over heads

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        gqa = q.shape[2] != k.shape[2]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=gqa)
        return out.transpose(1, 2)
