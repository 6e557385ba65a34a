"""Causal ring attention over the context-parallel group, with the load-balanced "zigzag" split.

Ring attention (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers", sec. 3):
each of the CP ranks keeps its queries and passes its key/value block around a ring; after CP steps
every query has seen every key. Partial results are merged with their log-sum-exp (the online
softmax of Milakov & Gimelshein 2018, as in FlashAttention, Dao et al. 2022 sec. 3.1), in fp32.

Load balance (the "2-chunk"/zigzag split of Megatron-LM's context parallelism and of
ring-flash-attention's `zigzag_ring_flash_attn`): the sequence is cut into 2*CP chunks of
c = S/(2*CP) tokens and cp rank r holds chunks r and 2*CP-1-r, in that order. With a causal mask, at
ring step s (K/V from rank src = r - s mod CP):
- s = 0: my queries against my keys, causal (chunk order is increasing, so the local causal mask is
  the global one);
- src < r: both my query chunks see all of the *first* K/V chunk src and none of the second;
- src > r: only my *second* query chunk (2*CP-1-r) sees anything, and it sees both K/V chunks.
Every step after the first is c x 2c query-key pairs on every rank: equal work, no idle ranks.

The next K/V block travels (`shiftlm.comm.p2p.exchange`: one NCCL group, since at cp=2 the two ranks send to each other; counted and ledgered) while the current
one is computed. The backward is written by hand (`RingAttention`, not autograd through the ring):
K/V circulate again, and each rank adds its dK/dV contribution for the block it holds to an fp32
accumulator that travels with the block and arrives home after CP hops (Liu et al. 2023, Alg. 1
backward; FlashAttention-2's block backward with the final output and log-sum-exp, Dao 2023 Alg. 2).

GQA: K/V keep their own heads on the wire; query head h uses KV head h // (Hq/Hkv). Queries are
folded to [B, Hkv, groups*T, D] so that each block is one kernel call per KV head, never an expanded
K/V. Block kernel: PyTorch's CPU flash kernel (it returns the log-sum-exp and its backward takes the
final output and log-sum-exp) on CPU; plain fp32 matmuls over one block elsewhere.
Sliding-window attention is not supported here (`ParallelConfig.check_model` refuses it with cp > 1).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from shiftlm.comm import CommGroup
from shiftlm.comm.p2p import exchange

KV_TAG, DKV_TAG = 16, 17  # distinct tags: K/V and dK/dV rings share a neighbour in the backward


def zigzag_indices(seq_len: int, cp: int, rank: int) -> np.ndarray:
    """Global token indices held by cp rank `rank`: chunk `rank`, then chunk 2*cp-1-rank."""
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return np.concatenate((np.arange(first, first + chunk), np.arange(second, second + chunk)))


def sequence_indices(seq_len: int, cp: int, cp_rank: int, sp: int, sp_rank: int) -> np.ndarray:
    """Global token indices of rank (cp_rank, sp_rank): the zigzag split over cp, then a contiguous
    Ulysses slice of those tokens over sp (the Ulysses all-to-all regathers the cp rank's tokens)."""
    mine = zigzag_indices(seq_len, cp, cp_rank) if cp > 1 else np.arange(seq_len)
    width = len(mine) // sp
    return mine[sp_rank * width : (sp_rank + 1) * width]


def unzigzag(gathered: torch.Tensor, cp: int, dim: int = 1) -> torch.Tensor:
    """Concatenation of every cp rank's tokens (rank order) -> the sequence in its natural order."""
    if cp == 1:
        return gathered
    seq_len = gathered.shape[dim]
    order = np.concatenate([zigzag_indices(seq_len, cp, r) for r in range(cp)])
    inverse = torch.as_tensor(np.argsort(order), device=gathered.device)
    return gathered.index_select(dim, inverse)


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _use_flash(q: torch.Tensor) -> bool:
    """PyTorch's CPU flash kernel returns the log-sum-exp and takes it back in its backward; on other
    devices (and older torch) the plain-matmul block kernel below is used."""
    return q.device.type == "cpu" and _FLASH_CPU is not None and _FLASH_CPU_BACKWARD is not None


def _block_forward(q, k, v, causal: bool, scale: float):
    """q: [B, Hkv, G, Tq, D] (fp32), k/v: [B, Hkv, Tk, D] -> out [B, Hkv, G, Tq, D], lse [B, Hkv, G, Tq].

    Without a mask the G query heads of a KV head are folded into the rows (one kernel call per
    block, K/V never expanded); the causal (diagonal) block runs one call per query group."""
    b, hkv, g, tq, d = q.shape
    if not _use_flash(q):
        return _math_forward(q, k, v, causal, scale)
    if causal:
        parts = [_FLASH_CPU(q[:, :, i].contiguous(), k, v, 0.0, True, scale=scale) for i in range(g)]
        return torch.stack([p[0] for p in parts], 2), torch.stack([p[1] for p in parts], 2)
    out, lse = _FLASH_CPU(q.reshape(b, hkv, g * tq, d), k, v, 0.0, False, scale=scale)
    return out.view(b, hkv, g, tq, d), lse.view(b, hkv, g, tq)


def _block_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """Gradients of one block given the *final* output and log-sum-exp of these queries
    (FlashAttention-2's backward, Dao 2023 Alg. 2): -> dq [B, Hkv, G, Tq, D], dk, dv [B, Hkv, Tk, D]."""
    b, hkv, g, tq, d = q.shape
    if not _use_flash(q):
        return _math_backward(dout, q, k, v, out, lse, causal, scale)
    if causal:
        dq, dk, dv = [], 0, 0
        for i in range(g):
            dq_i, dk_i, dv_i = _FLASH_CPU_BACKWARD(
                dout[:, :, i].contiguous(), q[:, :, i].contiguous(), k, v, out[:, :, i].contiguous(),
                lse[:, :, i].contiguous(), 0.0, True, scale=scale,
            )  # fmt: skip
            dq.append(dq_i)
            dk, dv = dk + dk_i, dv + dv_i
        return torch.stack(dq, 2), dk, dv
    fold = (b, hkv, g * tq, d)
    dq, dk, dv = _FLASH_CPU_BACKWARD(
        dout.reshape(fold), q.reshape(fold), k, v, out.reshape(fold), lse.reshape(b, hkv, g * tq),
        0.0, False, scale=scale,
    )  # fmt: skip
    return dq.view(b, hkv, g, tq, d), dk, dv


def _math_forward(q, k, v, causal: bool, scale: float):
    """The same block in plain matmuls (any device): fp32 scores of this block only."""
    b, hkv, g, tq, d = q.shape
    s = _scores(q.reshape(b, hkv, g * tq, d), k, causal, g, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v)
    return out.view(b, hkv, g, tq, d), lse.view(b, hkv, g, tq)


def _math_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    b, hkv, g, tq, d = q.shape
    fold = (b, hkv, g * tq, d)
    qf, doutf = q.reshape(fold), dout.reshape(fold)
    delta = (doutf * out.reshape(fold)).sum(-1, keepdim=True)  # rowsum(dO * O) of the final output
    p = torch.exp(_scores(qf, k, causal, g, scale) - lse.reshape(b, hkv, g * tq, 1))
    dv = torch.matmul(p.transpose(-1, -2), doutf)  # sums over the query groups of each KV head
    ds = p * (torch.matmul(doutf, v.transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    return dq.view(b, hkv, g, tq, d), dk, dv


def _scores(q, k, causal: bool, groups: int, scale: float) -> torch.Tensor:
    """q: [B, Hkv, G*Tq, D] (rows ordered group-major), k: [B, Hkv, Tk, D] -> fp32 scores."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        tq, tk = q.shape[2] // groups, k.shape[2]
        future = torch.ones(tq, tk, dtype=torch.bool, device=q.device).triu(1).repeat(groups, 1)
        s = s.masked_fill(future, float("-inf"))
    return s


def _blocks(step: int, rank: int, cp: int, tokens: int) -> tuple[slice, slice, bool]:
    """(query rows, key columns, causal) of ring step `step` in the zigzag split (module docstring)."""
    chunk = tokens // 2
    if step == 0:
        return slice(0, tokens), slice(0, tokens), True
    if (rank - step) % cp < rank:
        return slice(0, tokens), slice(0, chunk), False
    return slice(chunk, tokens), slice(0, tokens), False


def _neighbours(group: CommGroup) -> tuple[int, int]:
    """Global ranks of the next and the previous cp rank on the ring."""
    r, n = group.rank, group.size
    return group.ranks[(r + 1) % n], group.ranks[(r - 1) % n]


def _circulate(block: torch.Tensor, group: CommGroup) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (step, the K/V block held at that step); the next block is in flight meanwhile."""
    nxt, prev = _neighbours(group)
    current = block
    for step in range(group.size):
        works = []
        if step < group.size - 1:
            incoming = torch.empty_like(current)
            works = exchange(
                [(current, nxt)], [(incoming, prev)], group, KV_TAG
            )  # one NCCL group: cp=2 crosses
        yield step, current
        for work in works:
            work.wait()
        if works:
            current = incoming


def _fold_queries(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, T, H, D] -> [B, Hkv, H/Hkv, T, D] (query head h = kv_head * groups + g), fp32."""
    b, t, h, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b, kv_heads, h // kv_heads, t, d).float()


def _unfold_queries(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    b, hkv, g, t, d = x.shape
    return x.reshape(b, hkv * g, t, d).permute(0, 2, 1, 3).to(dtype)


def _ring_forward(q, k, v, group: CommGroup, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, T, Hq, D], log-sum-exp [B, Hkv, Hq/Hkv, T] fp32): K/V once around the ring."""
    kv_heads, tokens = k.shape[2], q.shape[1]
    qh = _fold_queries(q, kv_heads)
    kv = torch.stack((k, v)).permute(0, 1, 3, 2, 4).contiguous()  # [2, B, Hkv, T, D], sent as is
    out = torch.zeros_like(qh)
    lse = torch.full(qh.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    for step, block in _circulate(kv, group):
        rows, cols, causal = _blocks(step, group.rank, group.size, tokens)
        block = block.float()
        part, part_lse = _block_forward(
            qh[..., rows, :], block[0][:, :, cols], block[1][:, :, cols], causal, scale
        )
        _merge(out[..., rows, :], lse[..., rows], part, part_lse)
    return _unfold_queries(out, q.dtype), lse


def _ring_backward(grad_out, q, k, v, out, lse, group: CommGroup, scale: float):
    """(dq, dk, dv): K/V around the ring again, with a travelling fp32 dK/dV accumulator (cp hops)."""
    kv_heads, tokens = k.shape[2], q.shape[1]
    nxt, prev = _neighbours(group)
    qh, dout, out = (_fold_queries(t, kv_heads) for t in (q, grad_out, out))
    kv = torch.stack((k, v)).permute(0, 1, 3, 2, 4).contiguous()
    dq = torch.zeros_like(qh)
    sends, pending = [], None
    for step, block in _circulate(kv, group):
        rows, cols, causal = _blocks(step, group.rank, group.size, tokens)
        block = block.float()
        dq_part, dk_part, dv_part = _block_backward(
            dout[..., rows, :], qh[..., rows, :], block[0][:, :, cols], block[1][:, :, cols],
            out[..., rows, :], lse[..., rows], causal, scale,
        )  # fmt: skip
        dq[..., rows, :] += dq_part
        if pending is None:  # step 0: a fresh accumulator for my own block
            acc = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        else:  # the accumulator of this block's owner, from the previous rank
            pending[0].wait()
            acc = pending[1]
        acc[0][:, :, cols] += dk_part
        acc[1][:, :, cols] += dv_part
        if group.size == 1:
            break
        incoming = torch.empty_like(acc)
        send, recv = exchange([(acc, nxt)], [(incoming, prev)], group, DKV_TAG)
        sends.append(send)
        pending = (recv, incoming)
    if pending is not None:  # after cp hops my own block's accumulator is back
        pending[0].wait()
        acc = pending[1]
    for work in sends:
        work.wait()
    dkv = acc.permute(0, 1, 3, 2, 4)  # dK and dV: copies, not views of one buffer (a custom op's rule)
    return _unfold_queries(dq, q.dtype), torch.empty_like(k).copy_(dkv[0]), torch.empty_like(v).copy_(dkv[1])


# The ring's two passes as custom ops: opaque to `torch.compile` (dynamo cannot trace the P2P
# exchanges), so a compiled context-parallel block stays one graph around them (model/compile.py).
@torch.library.custom_op("shiftlm::ring_attention", mutates_args=())
def _ring_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: str, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _ring_forward(q, k, v, CommGroup.by_key(group), scale)


@_ring_op.register_fake
def _(q, k, v, group, scale):
    b, t, h, d = q.shape
    kv_heads = k.shape[2]
    return torch.empty_like(q), q.new_empty((b, kv_heads, h // kv_heads, t), dtype=torch.float32)


@torch.library.custom_op("shiftlm::ring_attention_backward", mutates_args=())
def _ring_backward_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    group: str,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _ring_backward(grad_out, q, k, v, out, lse, CommGroup.by_key(group), scale)


@_ring_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, group, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


for _op in (_ring_op, _ring_backward_op):  # every rank runs the ring (comm/ops.py: never dead code)
    torch.fx.node.has_side_effect(_op._opoverload)


class RingAttention(torch.autograd.Function):
    """forward: causal attention of zigzag-split q/k/v over the cp ring; backward: the K/V ring again
    plus a travelling fp32 dK/dV accumulator (cp hops)."""

    @staticmethod
    def forward(ctx, q, k, v, group: CommGroup, scale: float):
        result, lse = _ring_op(q, k, v, group.key, scale)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.key, ctx.scale = group.key, scale
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward_op(grad_out.contiguous(), q, k, v, out, lse, ctx.key, ctx.scale)
        return dq, dk, dv, None, None


def _merge(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Online softmax (in place, fp32): out, lse <- the merge of (out, lse) and (part, part_lse)."""
    new = torch.logaddexp(lse, part_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(part * torch.exp(part_lse - new).unsqueeze(-1))
    lse.copy_(new)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Causal attention over the cp ring. q: [B, T, Hq, D], k/v: [B, T, Hkv, D], T = this rank's two
    zigzag chunks (`zigzag_indices`), Hq a multiple of Hkv -> [B, T, Hq, D]."""
    if q.shape[1] % 2:
        raise ValueError(
            f"ring attention needs an even number of local tokens (two chunks), got {q.shape[1]}"
        )
    return RingAttention.apply(q, k, v, group, 1.0 / math.sqrt(q.shape[-1]))
