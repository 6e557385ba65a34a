"""One rank's forward pass of a step in either Shift Parallelism mode, over one set of weights.

The weights are the core model's SP x TP shards (`build_model` on a Mesh with tp=T, sp=S): rank (sp, tp)
holds TP shard `tp`. Full TP over P = S*T ranks needs shard j = tp*S + sp of every projection, which is
sub-slice `sp` of TP shard `tp` (docs/design.md "Shift Parallelism"), so the full-TP weights below are
`narrow` views of the same tensors: rows of q/k/v/gate/up, columns of o/down, rows of the LM head.
No weight exists twice. The embedding stays TP-sharded in both modes (a lookup costs nothing to
repeat; only its all-reduce runs over the tp group instead of all P ranks).

- SP x TP: rank sp embeds and projects its contiguous slice of the (padded) tokens; an all-to-all over
  sp turns "my tokens, my TP heads" into "all tokens, head block j" (the core Ulysses attention's own
  exchange), K/V go into the cache, attention runs, a second all-to-all brings the outputs back, and
  row-parallel sums run over the tp group.
- Full TP: every rank takes all tokens, computes head block j directly, and sums over all P ranks.
Either way rank (sp, tp) writes and reads the K/V of head block j (KV head floor(j*KV/P) when KV < P).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shiftlm.comm import all_reduce, all_to_all_along
from shiftlm.config import ConfigError
from shiftlm.mesh import Mesh
from shiftlm.model.rope import apply_rope, rope_cos_sin
from shiftlm.model.sharding import kv_heads_of_block
from shiftlm.model.transformer import Transformer
from shiftlm.serve.logits import full_tp_vocab_part, logits_block
from shiftlm.serve.paged_attention import FlatBatch, PagedKVCache
from shiftlm.serve.scheduler import Mode


@dataclass(frozen=True)
class LayerWeights:
    """The projections of one decoder layer as one mode uses them (tensors or views of them)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None


def _part(tensor: torch.Tensor | None, dim: int, start: int, length: int) -> torch.Tensor | None:
    return None if tensor is None else tensor.narrow(dim, start, length)


class ShiftModel:
    """Runs a step on this rank in either mode; returns its share of the sampled rows' logits."""

    def __init__(self, model: Transformer, mesh: Mesh, cache: PagedKVCache):
        config = model.config
        self.model, self.mesh, self.cache, self.config = model, mesh, cache, config
        sp, tp = mesh.config.sp, mesh.config.tp
        if config.intermediate_size % (sp * tp):
            raise ConfigError(f"sp*tp = {sp * tp} must divide intermediate_size = {config.intermediate_size}")
        self.layers = list(model.model.layers.values())
        self.sp_tp_weights = [self._tp_shard(layer) for layer in self.layers]
        self.full_tp_weights = [self._full_tp_view(w) for w in self.sp_tp_weights]
        head = model.head_weight  # [padded_vocab / T, hidden]
        self.vocab_per_tp = head.shape[0]
        self.head_view = head.narrow(0, *full_tp_vocab_part(mesh.coords.sp, sp, self.vocab_per_tp))

    def _tp_shard(self, layer) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        return LayerWeights(
            q=attn.q_proj.weight,
            k=attn.k_proj.weight,
            v=attn.v_proj.weight,
            o=attn.o_proj.weight,
            gate=mlp.gate_proj.weight,
            up=mlp.up_proj.weight,
            down=mlp.down_proj.weight,
            q_bias=attn.q_proj.bias,
            k_bias=attn.k_proj.bias,
            v_bias=attn.v_proj.bias,
        )

    def _full_tp_view(self, w: LayerWeights) -> LayerWeights:
        """Shard j = tp*SP + sp of P as views into TP shard tp (sub-slice sp)."""
        config, coords = self.config, self.mesh.coords
        sp, tp = self.mesh.config.sp, self.mesh.config.tp
        d = config.head_dim
        q_rows = config.num_heads // (sp * tp) * d
        tp_first_kv, _ = kv_heads_of_block(coords.tp, tp, config.num_kv_heads)
        kv_first, kv_last = kv_heads_of_block(self.mesh.shard_index, sp * tp, config.num_kv_heads)
        kv_start, kv_rows = (kv_first - tp_first_kv) * d, (kv_last - kv_first) * d
        ffn = config.intermediate_size // (sp * tp)
        return LayerWeights(
            q=w.q.narrow(0, coords.sp * q_rows, q_rows),
            k=w.k.narrow(0, kv_start, kv_rows),
            v=w.v.narrow(0, kv_start, kv_rows),
            o=w.o.narrow(1, coords.sp * q_rows, q_rows),
            gate=w.gate.narrow(0, coords.sp * ffn, ffn),
            up=w.up.narrow(0, coords.sp * ffn, ffn),
            down=w.down.narrow(1, coords.sp * ffn, ffn),
            q_bias=_part(w.q_bias, 0, coords.sp * q_rows, q_rows),
            k_bias=_part(w.k_bias, 0, kv_start, kv_rows),
            v_bias=_part(w.v_bias, 0, kv_start, kv_rows),
        )

    @torch.no_grad()
    def forward(self, batch: FlatBatch, mode: Mode) -> torch.Tensor:
        """The logits block this rank owns (`logits.logits_block`): [its sampled rows, its vocab columns]."""
        ulysses = mode is Mode.SP_TP and self.mesh.sp.size > 1
        token_ids, positions = batch.token_ids, batch.positions
        if ulysses:
            per_rank = token_ids.numel() // self.mesh.sp.size
            first_row = self.mesh.coords.sp * per_rank
            token_ids = token_ids[first_row : first_row + per_rank]
            positions = positions[first_row : first_row + per_rank]
        weights = self.sp_tp_weights if mode is Mode.SP_TP else self.full_tp_weights
        reduce_group = self.mesh.tp if mode is Mode.SP_TP else self.mesh.shift
        hidden = self.model.model.embed_tokens(token_ids)
        cos, sin = rope_cos_sin(self.model.inv_freq, positions, hidden.dtype)
        for index, (layer, w) in enumerate(zip(self.layers, weights)):
            attn_out = self._attention(index, layer.input_layernorm(hidden), w, cos, sin, batch, ulysses)
            hidden = hidden + all_reduce(F.linear(attn_out, w.o), reduce_group)
            x = layer.post_attention_layernorm(hidden)
            mlp_out = F.linear(F.silu(F.linear(x, w.gate)) * F.linear(x, w.up), w.down)
            hidden = hidden + all_reduce(mlp_out, reduce_group)
        block = logits_block(batch, mode, self.mesh.coords, self.mesh.config.sp, self.vocab_per_tp)
        head = self.model.head_weight if mode is Mode.SP_TP else self.head_view
        return F.linear(self.model.model.norm(hidden[block.hidden_rows]), head)

    def _attention(
        self, index: int, x: torch.Tensor, w: LayerWeights, cos, sin, batch: FlatBatch, ulysses: bool
    ) -> torch.Tensor:
        d, tokens = self.config.head_dim, x.shape[0]
        q = F.linear(x, w.q, w.q_bias).view(tokens, -1, d)
        k = F.linear(x, w.k, w.k_bias).view(tokens, -1, d)
        v = F.linear(x, w.v, w.v_bias).view(tokens, -1, d)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if ulysses:  # [my tokens, my TP heads] -> [all tokens, head block j], as in training's Ulysses
            q, k, v = (
                t.squeeze(0) for t in self.layers[index].self_attn.scatter_heads(q[None], k[None], v[None])
            )
        self.cache.write(index, batch.slots, k, v)
        out = self.cache.attend(index, q, batch, self.config.sliding_window)
        if ulysses:
            out = all_to_all_along(out, self.mesh.sp, scatter_dim=0, gather_dim=1)
        return out.flatten(1)
