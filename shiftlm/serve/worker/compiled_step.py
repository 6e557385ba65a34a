"""A pure decode step as one `torch.compile`d function (inductor): the serving runner's default on a
single rank in full-TP mode; `--enforce-eager` keeps the eager step (docs/serving.md "Compiled decode").

The eager step runs ~300 small ops (norms, RoPE, reshapes, residual adds, ...) at a few microseconds
of dispatch each; inductor fuses them into a few C++ kernels a layer around the GEMMs (extern `mm`).
The function is tensor code only, so it compiles to one graph without breaks (`fullgraph=True`): its
inputs are the step's token ids, positions, slots, gather index, mask bias and sampled rows, the cache
storage, and the weights (passed in, so their identity is not guarded: no recompiles), with Q|K|V and
gate|up concatenated once (one more copy of those weights). Attention stays the eager code as one
custom op per layer (`paged_decode_attention`: cache write, gather into the cache's kept buffers,
SDPA): inlined, inductor cloned the whole cache per layer for a mutated view, and its dynamic-context
kernels ran 2-4x slower than eager's at 8-64 sequences. So the graph's only dynamic size is the context
length, inside the gather index and mask (`warm_up`, at startup: one compile per batch size).

Applies to: one rank (shift group of 1), fp32, a pure decode step (one query per sequence, no stream
rotation) of at most `max_seqs` sequences (those where MKL's GEMV is the faster linear): the latency case (TPOT one request at a time). Everything
else (larger batches, prefill and mixed steps, several ranks) runs the eager step.
"""

from __future__ import annotations

import logging
import os
import time
import types
import weakref

import torch
import torch.nn.functional as F

from shiftlm.model.transformer import Transformer
from shiftlm.serve.worker.paged_attention import FlatBatch, PagedAttention, PagedKVCache, kernel_decode

log = logging.getLogger(__name__)
_CACHES: weakref.WeakValueDictionary[int, PagedKVCache] = (
    weakref.WeakValueDictionary()
)  # storage address -> cache


@torch.library.custom_op("shiftlm::paged_decode_attention", mutates_args=("storage",))
def paged_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    storage: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
    block_index: torch.Tensor,
    bias: torch.Tensor,
    positions: torch.Tensor,
    window: int,
) -> torch.Tensor:
    """The eager decode attention of one layer (PagedAttention's lean path, the same calls): write K/V
    [S, Hkv, D] into `storage` (a `PagedKVCache`'s) at `slots`, attend q [S, Hq, D] -> [S, Hq, D] with
    the cache's CPU kernel if it has one, else gather the blocks into the cache's kept buffers for
    SDPA. Opaque to inductor: the context length stays inside, so the compiled graph's only dynamic
    size is the batch, and the gather keeps its buffers."""
    cache = _CACHES[storage.data_ptr()]
    cache.write(layer, slots, k, v)
    if cache.kernel is not None:
        return kernel_decode(cache, layer, q, block_index, positions, window)
    seqs, heads, d = q.shape
    keys, values = cache.gather(layer, block_index, seqs)
    folded = q.reshape(seqs, keys.shape[1], -1, d)
    return F.scaled_dot_product_attention(folded, keys, values, attn_mask=bias).reshape(seqs, heads, d)


@paged_decode_attention.register_fake
def _(q, k, v, storage, layer, slots, block_index, bias, positions, window):
    return torch.empty_like(q)


class CompiledDecode:
    """The compiled decode step of one rank's model and cache; `applies(batch)` says when to use it."""

    def __init__(self, model: Transformer, cache: PagedKVCache, max_seqs: int):
        """`max_seqs`: the largest batch it runs (`ShiftModel` passes the row counts for which MKL's GEMV,
        the graph's extern `mm`, beats oneDNN's packed GEMM that eager uses: compiled was 1.20x / 1.06x
        eager's step at 8 / 32 sequences, where eager runs oneDNN)."""
        config = model.config
        self.cache = cache
        self.max_seqs = max_seqs
        self.window = config.sliding_window or 0  # the plan's groups carry the same (plan_codec)
        layers = list(model.model.layers.values())
        with torch.no_grad():
            self.weights = tuple(
                (
                    layer.input_layernorm.weight.detach(),
                    torch.cat([p.weight.detach() for p in _qkv(layer)]),
                    _bias(layer),
                    layer.self_attn.o_proj.weight.detach(),
                    layer.post_attention_layernorm.weight.detach(),
                    torch.cat((layer.mlp.gate_proj.weight.detach(), layer.mlp.up_proj.weight.detach())),
                    layer.mlp.down_proj.weight.detach(),
                )
                for layer in layers
            )
        self.embed = model.model.embed_tokens.weight.detach()
        self.norm = model.model.norm.weight.detach()
        self.head = model.head_weight.detach()
        self.ends = (self.embed, self.norm, self.head, model.inv_freq)
        _CACHES[cache.storage.data_ptr()] = cache
        shape = (config.num_heads, cache.storage.shape[3], config.head_dim)
        self._fn = torch.compile(_decode_step(shape, config.rms_norm_eps), fullgraph=True)
        self.steps = 0  # steps run compiled (tests check the path is taken)

    @staticmethod
    def supports(model: Transformer, shift_size: int) -> bool:
        """The model and layout this path covers (else the runner keeps the eager step)."""
        return (
            shift_size == 1
            and not model.config.is_moe  # a dense Llama's step: the MoE layers run eager
            and model.head_weight.device.type == "cpu"  # built around MKL's GEMV; GPUs keep the eager step
            and model.with_embedding
            and model.with_head
            and model.model.norm.weight.dtype == torch.float32  # eager's RMSNorm is F.rms_norm in fp32 only
        )

    def applies(self, batch: FlatBatch) -> bool:
        """A pure decode step of at most `max_seqs` sequences (PagedAttention's lean path: row i is
        sequence i, one query each)."""
        return (
            batch.token_ids.shape[0] <= self.max_seqs
            and PagedAttention.is_decode(batch)
            and batch.num_tokens == batch.slots.numel()
        )

    @torch.no_grad()
    def __call__(self, batch: FlatBatch) -> torch.Tensor:
        """The sampled rows' logits [samples, padded vocab], as `ShiftModel.forward` returns them."""
        self.steps += 1
        group = batch.chunks[0]
        bias = group.bias(self.embed.dtype)
        args = (batch.token_ids, batch.positions, batch.slots, group.block_index, bias, batch.sample_rows)
        args += (group.window,)
        return self._fn(*args, self.cache.storage, self.weights, self.ends)

    @torch.no_grad()
    def warm_up(self) -> None:
        """Compile now, one graph per batch size it applies to (any context length), on a dummy step
        that writes slots of block 0, then zero the cache; one log line each."""
        device = self.embed.device
        announce = int(os.environ.get("RANK", "0")) == 0  # one rank says it, before the wait
        if announce:
            log.info(
                "compiling the decode step for 1-%d sequence(s) (torch.compile, ~15 s each on 2 cores; "
                "--enforce-eager skips this)",
                self.max_seqs,
            )
        for seqs in range(1, self.max_seqs + 1):
            start = time.perf_counter()
            rows = torch.arange(seqs, device=device)
            blocks = torch.zeros(2 * seqs, dtype=torch.long, device=device)  # 2 blocks a sequence
            bias = torch.zeros(seqs, 1, 1, 2 * self.cache.block_size, dtype=self.embed.dtype, device=device)
            args = (
                torch.zeros_like(rows),
                torch.zeros_like(rows),
                rows,
                blocks,
                bias,
                rows.clone(),
                self.window,
            )
            # every context length in one graph per batch size (unbacked: one block, i.e. a size of 1,
            # is not specialized into a graph of its own)
            torch._dynamo.decorators.mark_unbacked(blocks, 0)
            torch._dynamo.decorators.mark_unbacked(bias, 3)
            self._fn(*args, self.cache.storage, self.weights, self.ends)
            if announce:
                log.info(
                    "compiled the decode step of %d sequence(s) in %.1f s", seqs, time.perf_counter() - start
                )
        self.cache.storage.zero_()


def _qkv(layer) -> tuple:
    attn = layer.self_attn
    return (attn.q_proj, attn.k_proj, attn.v_proj)


def _bias(layer) -> torch.Tensor | None:
    """Q|K|V's concatenated bias (qwen2), None without biases."""
    if all(p.bias is None for p in _qkv(layer)):
        return None
    return torch.cat(
        [p.weight.new_zeros(p.weight.shape[0]) if p.bias is None else p.bias.detach() for p in _qkv(layer)]
    )


def _decode_step(shape: tuple[int, int, int, int], eps: float):
    """The whole decode step as tensor code (compiled with fullgraph=True), the model's sizes closed
    over as constants. Same math as the eager step (model/transformer.py, paged_attention.py)."""
    heads, kv_heads, d = shape

    def step(*args):
        return _step(heads, kv_heads, d, eps, *args)

    # a code object of its own per model: dynamo keeps at most 8 graphs per code object, so models
    # (tests load several) sharing one would run out
    return types.FunctionType(
        step.__code__.replace(), step.__globals__, "decode_step", None, step.__closure__
    )


def _step(
    heads, kv_heads, d, eps, ids, positions, slots, block_index, bias, rows, window, storage, weights, ends
):
    embed, norm, head, inv_freq = ends
    seqs = ids.shape[0]
    hidden = heads * d
    x = F.embedding(ids, embed)
    freqs = positions.float().unsqueeze(-1) * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos().to(x.dtype).unsqueeze(1), angles.sin().to(x.dtype).unsqueeze(1)
    width = x.shape[-1]
    for layer, (ln1, qkv_w, qkv_b, o_w, ln2, gate_up_w, down_w) in enumerate(weights):
        h = F.rms_norm(x, (width,), ln1, eps)
        q, k, v = F.linear(h, qkv_w, qkv_b).split((hidden, kv_heads * d, kv_heads * d), dim=-1)
        q = _rope(q.view(seqs, heads, d), cos, sin)
        k = _rope(k.view(seqs, kv_heads, d), cos, sin)
        v = v.reshape(seqs, kv_heads, d)
        out = paged_decode_attention(q, k, v, storage, layer, slots, block_index, bias, positions, window)
        x = x + F.linear(out.reshape(seqs, hidden), o_w)
        gate, up = F.linear(F.rms_norm(x, (width,), ln2, eps), gate_up_w).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, down_w)
    return F.linear(F.rms_norm(x[rows], (width,), norm, eps), head)


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
