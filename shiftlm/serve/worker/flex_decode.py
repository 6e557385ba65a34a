"""Decode attention read straight from the paged KV cache with PyTorch's FlexAttention
(`--attention-backend flex`; issue 34's candidate for CUDA, to be measured against gather + SDPA).

The gather path copies every sequence's context blocks into one buffer per layer and pads each
sequence to the step's longest context (to a power-of-two bucket in a CUDA graph). FlexAttention
instead takes the cache as it lies, K and V of a layer as [1, kv heads, slots, D] views of
`PagedKVCache.slots`, and a block mask whose KV blocks are the cache blocks: query row s (one
sequence's token) visits exactly its own blocks, in place, so a step costs what its contexts hold and
the context length is data (a tensor), not a shape.

Per sequence, with its query at position `pos` and the sliding window `w` (0: none), the keys it reads
are the positions lo..pos (lo = max(0, pos - w + 1), else 0), in logical blocks first = lo // B to
last = pos // B, all listed as blocks the mask is evaluated on: the blocks strictly inside pass it
whole, and in the last one and the first one the mask reads a slot's logical position from which of
the two it lies in. None is listed as a "full" block (mask skipped): with full blocks inductor's CUDA
flex-decoding kernel sizes its KV splits from the whole cache's length, so a sequence's blocks land
in one or two of them and a small batch runs on a few SMs (torch/_inductor/kernel/flex/templates/
flex_decode.py.jinja, `TILE_KV_OG`; vLLM's FlexAttention backend passes none either); without, the
splits share each sequence's own blocks. `flex_plan` builds this per step from the block tables and
positions with tensor ops only (no host sync: graph-capturable), once for every layer.

The attention itself is compiled (`torch.compile` of `flex_attention`: inductor writes a Triton
kernel on CUDA and a C++ one on the CPU, where the CPU tests run it), one graph per batch size, with
static shapes: inductor's CPU flex template fails to build with a symbolic batch (torch 2.13,
"cur_qSplitSize6 was not declared"), and on CUDA a symbolic batch leaves the flex-decoding kernel for
the main one, whose tiles do not divide a cache block (read in torch's source, not yet run on a GPU).
Triton's tiles also need a cache block of at least 16 tokens on CUDA (`flex_refusal`). So that the
compiles stay few, a call's queries are padded to vLLM's capture sizes (`padded_batch`): a mixed step's
decode rows, whose count is anything, reuse the functions the decode graphs' sizes compiled (on CUDA a
compile takes seconds, which a step must not wait for).
"""

from __future__ import annotations

import types

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from shiftlm.errors import ConfigError

# inductor's CPU FlexAttention kernel for a mask without its Q-block view overruns the heap before
# torch 2.13 (2.11: "corrupted size vs. prev_size", the process aborts); CUDA's Triton kernel is fine
CPU_FLEX_SINCE = (2, 13)
MIN_CUDA_BLOCK = 16  # tl.dot's smallest tile
# inductor's CUDA flex lowering refuses a head size under tl.dot's 16 ("NYI: embedding dimension ...
# must be at least 16", torch/_inductor/kernel/flex/flex_attention.py)
MIN_CUDA_HEAD_DIM = 16


def flex_refusal(device: torch.device | str, block_size: int = 16, head_dim: int | None = None) -> str | None:
    """Why `--attention-backend flex` cannot run on `device` with this torch, KV block size and head
    size (its kernel is known to be broken or missing there), as one line naming the fix; None where
    it runs."""
    if torch.device(device).type == "cuda" and block_size < MIN_CUDA_BLOCK:
        return (
            f"--attention-backend flex on CUDA needs --block-size >= {MIN_CUDA_BLOCK} (Triton's tiles), "
            f"got {block_size}: raise --block-size, or use --attention-backend auto"
        )
    if torch.device(device).type == "cuda" and head_dim is not None and head_dim < MIN_CUDA_HEAD_DIM:
        return (
            f"--attention-backend flex on CUDA needs a head size >= {MIN_CUDA_HEAD_DIM} (Triton's tiles); "
            f"this model's is {head_dim}: use --attention-backend auto"
        )
    if (
        torch.device(device).type != "cpu"
        or torch.torch_version.TorchVersion(torch.__version__) >= CPU_FLEX_SINCE
    ):
        return None
    return (
        f"--attention-backend flex on the CPU needs torch>={'.'.join(map(str, CPU_FLEX_SINCE))} "
        f"(this is {torch.__version__}, whose CPU FlexAttention kernel corrupts memory): upgrade "
        "torch, or use --attention-backend auto"
    )


def check_flex(device: torch.device | str, block_size: int = 16, head_dim: int | None = None) -> None:
    """Raise `flex_refusal`'s line as a ConfigError where there is one."""
    refusal = flex_refusal(device, block_size, head_dim)
    if refusal is not None:
        raise ConfigError(refusal)


def flex_plan(
    block_index: torch.Tensor, positions: torch.Tensor, window: int, block_size: int, slots: int
) -> list[torch.Tensor]:
    """The step's block mask as int32 tensors (`_attend`'s arguments after k and v): `block_index` the
    S sequences' block tables, sequence-major (past a sequence's blocks anything), `positions` each
    query's position (S values), `slots` the cache's slot count (FlexAttention's mask spans them all)."""
    seqs = positions.numel()
    tables, positions = block_index.view(seqs, -1), positions.reshape(seqs)
    columns = tables.shape[1]
    # a row lists the sequence's blocks first..last, in a row as wide as the cache has blocks (the
    # lowering asserts that the mask spans the KV length); the kernels read only the first `count`
    width = max(slots // block_size, 1)
    positions = positions.to(tables.dtype)
    low = (positions - window + 1).clamp(min=0) if window else torch.zeros_like(positions)
    first, last = low // block_size, positions // block_size
    steps = torch.arange(columns, device=tables.device)
    listed = tables.gather(1, (first[:, None] + steps).clamp(max=columns - 1))
    listed = torch.cat([listed, tables.new_zeros(seqs, width - columns)], 1)  # a table <= the cache
    count = last - first + 1
    last_block, first_block = tables.gather(1, last[:, None])[:, 0], tables.gather(1, first[:, None])[:, 0]
    pieces = [count.view(seqs, 1, 1), listed.view(seqs, 1, 1, width), last_block, first_block]
    pieces += [last, first, low, positions]
    return [piece.to(torch.int32).contiguous() for piece in pieces]


def _attend(q, k, v, count, blocks, last_block, first_block, last, first, low, pos, block_size: int):
    """q [S, Hq, 1, D], k/v [1, Hkv, slots, D] (views of the cache) -> [S, Hq, 1, D]."""

    def mask_mod(b, h, q_idx, kv_idx):
        block = kv_idx // block_size
        at_last, at_first = block == last_block[b], block == first_block[b]
        logical = torch.where(at_last, last[b], first[b]) * block_size + kv_idx % block_size
        # blocks strictly inside the range are whole; the first and last are cut at low and pos
        return (~at_last & ~at_first) | ((logical <= pos[b]) & (logical >= low[b]))

    # inductor's CPU flex kernel does not build without full blocks in bf16 (torch 2.13:
    # "'full_kv_num_blocks' was not declared"): on the CPU an empty list of them
    full = (torch.zeros_like(count), torch.zeros_like(blocks)) if q.device.type == "cpu" else (None, None)
    mask = BlockMask.from_kv_blocks(
        count,
        blocks,
        *full,
        BLOCK_SIZE=(Q_BLOCK, block_size),
        mask_mod=mask_mod,
        seq_lengths=(1, k.shape[2]),
        compute_q_blocks=False,
    )
    return flex_attention(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


# the mask's query block: one query per sequence fits in one; Triton's flex kernels need it divisible
# by their query tile (16 in the decoding kernel, up to 128 in the main one), or no config builds
Q_BLOCK = 128
_COMPILED: dict[tuple, object] = {}


def padded_batch(seqs: int) -> int:
    """The batch `seqs` sequences are padded to: vLLM's CUDA-graph sizes, 1, 2, 4, 8, then multiples of
    8 (`decode_graphs.capture_sizes` lists them); a FlexAttention call's queries are padded so, and each
    size compiles once."""
    return 1 << (seqs - 1).bit_length() if seqs <= 8 else -(-seqs // 8) * 8


def flex_decode(
    q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, plan: list[torch.Tensor], block_size: int
) -> torch.Tensor:
    """One query per sequence, q [S, Hq, D], over the cache's K/V of one layer [slots, Hkv, D] under
    `plan` (`flex_plan`) -> [S, Hq, D]. Each compiled function is a code object of its own (dynamo
    keeps at most 8 graphs per code object), one per padded batch size (`padded_batch`; a padding row
    repeats row 0's query and mask) and cache shape: static shapes, so that on CUDA inductor picks its
    flex-decoding kernel (a symbolic batch takes the main kernel, whose 128-wide KV tiles do not
    divide a cache block)."""
    seqs = q.shape[0]
    extra = padded_batch(seqs) - seqs
    if extra:
        q, *plan = (torch.cat((t, t[:1].expand(extra, *t.shape[1:]))) for t in (q, *plan))
    key = (q.shape, q.dtype, q.device, k_slots.shape, block_size)
    fn = _COMPILED.get(key)
    if fn is None:
        code = types.FunctionType(_attend.__code__.replace(), _attend.__globals__, "flex_decode")
        fn = _COMPILED[key] = torch.compile(code, fullgraph=True, dynamic=False)
    k, v = (t.permute(1, 0, 2).unsqueeze(0) for t in (k_slots, v_slots))
    return fn(q.unsqueeze(2), k, v, *plan, block_size).squeeze(2)[:seqs]
