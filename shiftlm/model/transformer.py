"""The Llama-family decoder (llama, qwen2, mistral, and the mixture-of-experts mixtral, qwen2_moe, qwen3_moe:
model/moe.py) built from parallel layers, as a whole model or a stage.

Parameter names are the Hugging Face names (`model.layers.3.mlp.up_proj.weight`), layers keep their
global index, so a pipeline stage holding layers [4, 8) names them `model.layers.4` ... `model.layers.7`.

Data layout: tokens are [batch, seq]; activations [batch, seq, hidden]. With context parallelism each
cp rank holds two zigzag chunks of the sequence (model/ring_attention.py); with Ulysses SP each rank
holds the contiguous slice `sp` of those tokens; with Megatron sequence parallelism the activations between the
TP regions are further split over the TP group (and gathered back before the LM head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shiftlm.comm import SINGLE, CommGroup, copy_to_group, gather_along
from shiftlm.config import ModelConfig
from shiftlm.errors import ConfigError
from shiftlm.mesh import Mesh
from shiftlm.model.attention import Attention, AttentionBackend, FullTP
from shiftlm.model.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear, VocabParallelEmbedding
from shiftlm.model.loss import IGNORE_INDEX, chunked_head_cross_entropy, vocab_parallel_cross_entropy
from shiftlm.model.moe import SparseMoE, ffn_name, load_balancing_loss
from shiftlm.model.ops import PLAIN, Ops
from shiftlm.model.ring_attention import sequence_indices
from shiftlm.model.rope import inverse_frequencies, rope_cos_sin
from shiftlm.model.sharding import padded_vocab
from shiftlm.parallel import ParallelConfig


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate/up column-parallel, down row-parallel."""

    def __init__(self, config: ModelConfig, tp: CommGroup, sequence_parallel: bool):
        super().__init__()
        if not config.gated_mlp:
            raise ConfigError(
                f"hidden_act {config.hidden_act!r}: shiftlm's model runs SwiGLU (silu) MLPs only"
            )
        h, f = config.hidden_size, config.intermediate_size // tp.size
        self.gate_proj = ColumnParallelLinear(h, f, tp, sequence_parallel=sequence_parallel)
        self.up_proj = ColumnParallelLinear(h, f, tp, sequence_parallel=sequence_parallel)
        self.down_proj = RowParallelLinear(f, h, tp, sequence_parallel)
        self._views: tuple[tuple, tuple] | None = None

    def forward(self, x: torch.Tensor, full_tp: FullTP | None = None, ops: Ops = PLAIN) -> torch.Tensor:
        if full_tp is not None:  # sub-slice `part` of this TP shard's FFN columns, summed over all P ranks
            gate, up, down = self.full_tp_views(full_tp)
            hidden = ops.swiglu(x, gate, up)  # serving's ops: one GEMM on gate|up (packed), fused silu * up
            return full_tp.reduce(ops.linear(hidden, down))
        x = self.gate_proj.enter(x)
        return self.down_proj(ops.swiglu(x, self.gate_proj.weight, self.up_proj.weight), ops)

    def full_tp_views(self, full_tp: FullTP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sub-slice `part` of this TP shard's gate/up rows and down columns (views, taken once; inside
        a compiled graph taken there, where they are free)."""
        if not torch.compiler.is_compiling():
            key = (full_tp.part, full_tp.parts, self.gate_proj.weight.data_ptr())
            if self._views is None or self._views[0] != key:
                self._views = (key, self._make_views(full_tp))
            return self._views[1]
        return self._make_views(full_tp)

    def _make_views(self, full_tp: FullTP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ffn = self.gate_proj.weight.shape[0] // full_tp.parts
        start = full_tp.part * ffn
        return (
            self.gate_proj.weight.narrow(0, start, ffn),
            self.up_proj.weight.narrow(0, start, ffn),
            self.down_proj.weight.narrow(1, start, ffn),
        )


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        tp: CommGroup,
        sp: CommGroup,
        sequence_parallel: bool,
        cp: CommGroup | None = None,
        layer_index: int = 0,
        ep: CommGroup | None = None,
        etp: CommGroup | None = None,
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, tp, sp, sequence_parallel, cp, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # the feed-forward block under its HF name: `mlp` (dense or Qwen MoE) or Mixtral's `block_sparse_moe`
        self.ffn_name = ffn_name(config, layer_index)
        if config.is_moe_layer(layer_index):
            ffn: nn.Module = SparseMoE(config, tp, ep or SINGLE, sequence_parallel, etp)
        else:
            ffn = MLP(config, tp, sequence_parallel)
        setattr(self, self.ffn_name, ffn)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend | None = None,
        full_tp: FullTP | None = None,
        ops: Ops = PLAIN,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x, ops), cos, sin, backend, full_tp, ops)
        return x + getattr(self, self.ffn_name)(self.post_attention_layernorm(x, ops), full_tp, ops)


class _Body(nn.Module):
    """Holds the `model.*` submodules so that parameter names match Hugging Face."""


class Transformer(nn.Module):
    """A pipeline stage of the decoder: layers [first, last), plus embedding and/or head at the ends.

    forward(first stage: token ids [B, S_local]; other stages: hidden states) returns hidden states,
    or, on the last stage, vocab-parallel logits [B, S_local, padded_vocab/TP] (padding columns -inf);
    with `loss_chunk` > 0 (the trainer's `train.loss_chunk`) hidden states there too, and `loss` runs
    the final norm and the head `loss_chunk` tokens at a time (model/loss.py), never holding the whole
    batch's logits.
    """

    loss_chunk = 0

    def __init__(
        self,
        config: ModelConfig,
        mesh: Mesh | None = None,
        layers: tuple[int, int] | None = None,
        with_embedding: bool | None = None,
        with_head: bool | None = None,
    ):
        super().__init__()
        mesh = mesh or Mesh(ParallelConfig())
        mesh.config.check_model(config)
        if config.intermediate_size % mesh.config.tp:
            raise ConfigError(
                f"tp = {mesh.config.tp} must divide intermediate_size = {config.intermediate_size}"
            )
        first, last = layers if layers is not None else (0, config.num_layers)
        if not 0 <= first < last <= config.num_layers:
            raise ConfigError(
                f"layer range [{first}, {last}) is outside the model's {config.num_layers} layers"
            )
        self.config, self.mesh = config, mesh
        self.with_embedding = first == 0 if with_embedding is None else with_embedding
        self.with_head = last == config.num_layers if with_head is None else with_head
        with torch.device(mesh.device):  # parameters and buffers are created on the mesh's device
            self._build(config, mesh, first, last)

    def _build(self, config: ModelConfig, mesh: Mesh, first: int, last: int) -> None:
        self.layer_range = (first, last)
        self.sequence_parallel = mesh.config.sequence_parallel and mesh.tp.size > 1
        tp, sp = mesh.tp, mesh.sp

        vocab_local = padded_vocab(config, tp.size) // tp.size
        self.vocab_start = tp.rank * vocab_local
        self.model = _Body()
        if self.with_embedding:
            self.model.embed_tokens = VocabParallelEmbedding(
                self.vocab_start, vocab_local, config.hidden_size, tp, self.sequence_parallel
            )
        self.model.layers = nn.ModuleDict(
            {
                str(i): DecoderLayer(config, tp, sp, self.sequence_parallel, mesh.cp, i, mesh.ep, mesh.etp)
                for i in range(first, last)
            }
        )
        if self.with_head:
            self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            # a tied head on a stage without the embedding keeps its own copy (kept equal by the trainer)
            if not config.tie_word_embeddings or not self.with_embedding:
                self.lm_head = ColumnParallelLinear(config.hidden_size, vocab_local, tp)
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)
        vocab_ids = self.vocab_start + torch.arange(vocab_local)
        self.register_buffer("vocab_padding", vocab_ids >= config.vocab_size, persistent=False)
        # known here, so the head never asks the device (a sync per micro-batch, a graph break)
        self.has_vocab_padding = self.vocab_start + vocab_local > config.vocab_size

    @property
    def head_weight(self) -> torch.Tensor:
        if hasattr(self, "lm_head"):
            return self.lm_head.weight
        return self.model.embed_tokens.weight

    def positions(self, batch: int, tokens_local: int) -> torch.Tensor:
        """Global positions of this rank's tokens: the zigzag chunks of cp rank `cp`, then their
        Ulysses slice `sp` (`ring_attention.sequence_indices`; contiguous when cp = 1)."""
        cp, sp = self.mesh.cp, self.mesh.sp
        seq_len = tokens_local * sp.size * cp.size
        index = sequence_indices(seq_len, cp.size, cp.rank, sp.size, sp.rank)
        return torch.as_tensor(index, device=self.mesh.device).unsqueeze(0).expand(batch, -1)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        backend: AttentionBackend | None = None,
        ops: Ops = PLAIN,
    ) -> torch.Tensor:
        """`backend`: attention other than dense causal (multi-stream samples: `stream_mask.MaskedAttention`);
        `ops`: how the linears and norms run (model/ops.py: a zero-bubble pipeline's I + W forwards
        pass `DEFERRABLE`)."""
        hidden = self.hidden_states(x, positions, backend, ops=ops)
        if not self.with_head or self.loss_chunk:  # with loss_chunk the head runs inside `loss`
            return hidden
        return self.head(hidden, ops)

    def full_tp(self) -> FullTP:
        """Shift Parallelism's latency mode on this rank: P-way TP over the mesh's shift group."""
        return FullTP(self.mesh.shift, self.mesh.coords.sp, self.mesh.sp.size)

    def hidden_states(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        backend: AttentionBackend | None = None,
        full_tp: FullTP | None = None,
        ops: Ops = PLAIN,
    ) -> torch.Tensor:
        """The layers' output (before the final norm): training's forward, or serving's with a paged
        `backend` and, for full TP, every rank on all tokens (`full_tp`, see attention.FullTP)."""
        if self.with_embedding:
            batch, tokens = x.shape
            hidden = self.model.embed_tokens(x)
        else:
            hidden = x
            batch = x.shape[0]
            tokens = x.shape[1] * (self.mesh.tp.size if self.sequence_parallel else 1)
        if positions is None:
            positions = self.positions(batch, tokens)
        # [B, S, 1, head_dim]: broadcast over heads by every layer's RoPE without a per-layer unsqueeze
        cos, sin = (t.unsqueeze(-2) for t in rope_cos_sin(self.inv_freq, positions, hidden.dtype))
        for layer in self.model.layers.values():
            hidden = layer(hidden, cos, sin, backend, full_tp, ops=ops)
        return hidden

    def head_input(self, hidden: torch.Tensor, ops: Ops = PLAIN) -> torch.Tensor:
        """Final norm, brought into the TP region (every TP rank holds every token)."""
        hidden = self.model.norm(hidden, ops)
        if self.sequence_parallel:
            return gather_along(hidden, self.mesh.tp, dim=1)
        return copy_to_group(hidden, self.mesh.tp)

    def head(self, hidden: torch.Tensor, ops: Ops = PLAIN) -> torch.Tensor:
        """Final norm + vocab-parallel LM head; padding columns are -inf so they never win or weigh."""
        logits = ops.linear(self.head_input(hidden, ops), self.head_weight)  # DEFERRABLE: W can wait
        if self.has_vocab_padding:
            logits = logits.masked_fill(self.vocab_padding, float("-inf"))
        return logits

    def router_aux_loss(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The MoE load-balancing loss of the last forward (`moe.load_balancing_loss`): this rank's term
        of it (add `config.router_aux_loss_coef` times it to the loss) and its global value."""
        moe = [m for m in self.modules() if isinstance(m, SparseMoE)]
        return load_balancing_loss(moe, self.mesh.dp_sp, self.mesh.tp)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy of vocab-parallel logits (targets -100 are ignored); with
        `loss_chunk`, of the layers' output (`forward`'s then): norm, head and loss chunk by chunk."""
        if self.loss_chunk:
            padding = self.vocab_padding if self.has_vocab_padding else None
            hidden = self.head_input(logits)
            tp = self.mesh.tp
            return chunked_head_cross_entropy(
                hidden, self.head_weight, targets, tp, self.vocab_start, padding, self.loss_chunk
            )
        if self.mesh.tp.size == 1:
            return F.cross_entropy(
                logits.flatten(0, -2).float(), targets.flatten(), reduction="none", ignore_index=IGNORE_INDEX
            ).view(targets.shape)
        return vocab_parallel_cross_entropy(logits, targets, self.mesh.tp, self.vocab_start)


def stage_layers(num_layers: int, num_stages: int, stage: int) -> tuple[int, int]:
    """Contiguous, balanced layer range of pipeline stage `stage` (earlier stages get the remainder)."""
    base, extra = divmod(num_layers, num_stages)
    first = stage * base + min(stage, extra)
    return first, first + base + (1 if stage < extra else 0)
