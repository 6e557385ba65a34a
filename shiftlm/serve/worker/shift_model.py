"""One rank's forward pass of a step in either Shift Parallelism mode: the core model's own layers,
with the mode choosing how they run and the paged backend doing attention.

The weights are the core model's SP x TP shards (`build_model` on a Mesh with tp=T, sp=S): rank (sp, tp)
holds TP shard `tp` (docs/design.md "Shift Parallelism").

- SP x TP: rank sp embeds and projects its contiguous slice of the (padded) flat batch; the layers run
  exactly as in training, Ulysses all-to-all over sp included, with `PagedAttention` in place of dense
  causal attention; row-parallel sums run over the tp group.
- Full TP: every rank takes all tokens and the layers run with `attention.FullTP`: head block
  j = tp*S + sp as `narrow` views of the same shards (selected by the layer), sums over all P ranks.
  The embedding lookup uses the whole table on every rank (gathered once, up to FULL_EMBEDDING_BYTES),
  so neither mode spends an all-reduce on it; the LM head stays vocab-parallel.
Either way rank (sp, tp) writes and reads the K/V of head block j, so both modes share one cache.
Only the sampled rows go through the final norm and the LM head (`logits.logits_block`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shiftlm.comm import all_reduce
from shiftlm.mesh import Mesh
from shiftlm.model.compile import compile_usable
from shiftlm.model.inference_linear import GEMV_ROWS, PackedWeights
from shiftlm.model.moe import SparseMoE
from shiftlm.model.ops import InferenceOps
from shiftlm.model.transformer import Transformer
from shiftlm.serve.plan import Mode
from shiftlm.serve.worker.compiled_mixed import CompiledMixed
from shiftlm.serve.worker.compiled_step import CompiledDecode
from shiftlm.serve.worker.decode_graphs import DecodeGraphs
from shiftlm.serve.worker.logits import full_tp_vocab_part
from shiftlm.serve.worker.paged_attention import FlatBatch, PagedAttention, PagedKVCache

FULL_EMBEDDING_BYTES = 512 * 2**20  # a larger table stays vocab-parallel (one all-reduce per step)


class ShiftModel:
    """Runs a step on this rank in either mode; returns its share of the sampled rows' logits."""

    def __init__(
        self,
        model: Transformer,
        mesh: Mesh,
        cache: PagedKVCache,
        pack_weights: bool = True,
        compile_decode: bool = False,
        gemv_rows: int | None = None,
        compile_mixed: bool | None = None,
    ):
        """`compile_mixed`: steps that are not pure decodes as one compiled graph (`CompiledMixed`;
        None: with `compile_decode` on CUDA, where eager would launch every small op; on the CPU the
        eager step's oneDNN GEMMs and kernels are the faster ones, tests turn it on)."""
        config = model.config
        self.model, self.mesh, self.cache, self.config = model, mesh, cache, config
        sp = mesh.config.sp
        mesh.config.check_model(config, shift=True)  # serve's options check it before any rank starts
        self.full_tp = model.full_tp()
        head = model.head_weight  # [padded_vocab / T, hidden]
        self.vocab_per_tp = head.shape[0]
        self.head_view = head.narrow(0, *full_tp_vocab_part(mesh.coords.sp, sp, self.vocab_per_tp))
        embed = getattr(model.model, "embed_tokens", None)
        if embed is not None and mesh.tp.size > 1 and not embed.sequence_parallel:
            full_bytes = embed.weight.numel() * embed.weight.element_size() * mesh.tp.size
            if full_bytes <= FULL_EMBEDDING_BYTES:  # collective: every rank builds its ShiftModel
                parts = [torch.empty_like(embed.weight) for _ in range(mesh.tp.size)]
                dist.all_gather(parts, embed.weight.detach(), group=mesh.tp.pg)
                embed.full_table = torch.cat(parts)
        # oneDNN-layout copies of the weights each mode uses, made on the first step that uses them
        self.packed = PackedWeights(cache.kernel) if pack_weights else None
        if self.packed is not None:  # MKL's GEMV or oneDNN's packed GEMM for 1-2 rows: measured here
            if gemv_rows is None:  # unless the caller says (tests of one path)
                self.packed.choose_small_rows(_linear_groups(model))
            else:
                self.packed.gemv_rows = gemv_rows
        # the eager step's linears, norms and RoPE: oneDNN on the packed copies, the CPU kernels
        self.ops = InferenceOps(self.packed)
        # pure decode steps as one compiled function where it applies (serve/worker/compiled_step.py).
        # On the CPU the batches small enough for MKL's GEMV, which the graph calls (oneDNN's packed
        # GEMM, where it is faster, is not available inside the graph), one graph per size; on CUDA
        # every decode batch (at most one per block), one graph for all sizes
        cuda = model.head_weight.device.type == "cuda"
        max_seqs = cache.num_blocks if cuda else GEMV_ROWS if self.packed is None else self.packed.gemv_rows
        if compile_decode and mesh.shift.size > 1:  # the same graphs on every rank: their warm-up steps
            agreed = torch.tensor([max_seqs], device=mesh.device)  # run collectives (GEMV probes may differ)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=mesh.shift.pg)
            max_seqs = int(agreed)
        compiled = compile_decode and max_seqs > 0 and CompiledDecode.supports(model)
        # where inductor cannot build (no C++ compiler, no Triton): one warning line, the eager step
        compiled = compiled and compile_usable(
            "true", model.head_weight.device, "the compiled decode step", "--enforce-eager silences this"
        )
        # SP x TP decodes compiled too where the modes differ (several ranks), for dense models (a mixture
        # of experts' dispatch over ep is an uneven all-to-all whose counts are read on the host); on
        # CUDA only: the CPU compiles the latency case, and SP x TP is the throughput mode, whose
        # batches run oneDNN's faster GEMMs eagerly (a graph no step would use costs a compile at start)
        self.ulysses = (mesh.coords.sp, sp) if mesh.shift.size > 1 and not config.is_moe else None
        self.compiled = (
            CompiledDecode(
                model, cache, max_seqs, cuda, self.full_tp, self.head_view, self.ulysses if cuda else None
            )
            if compiled
            else None
        )
        if compile_mixed is None:
            compile_mixed = compile_decode and cuda
        # dense models only: a mixture of experts' routing put a bound on the token count (dynamo added
        # `tokens <= 4096` under the grouped GEMMs), so its prefill steps stay eager
        mixed = compile_mixed and CompiledDecode.supports(model) and not config.is_moe
        mixed = mixed and (
            compiled
            or compile_usable(
                "true", model.head_weight.device, "the compiled mixed step", "--enforce-eager silences this"
            )
        )
        self.compiled_mixed = (
            CompiledMixed(model, cache, self.full_tp, self.head_view, self.ulysses) if mixed else None
        )
        # decode steps replayed from CUDA graphs over the compiled step (decode_graphs.py; the runner
        # captures them after the compiles)
        self.graphs: DecodeGraphs | None = None
        # mixture of experts: each step's load per expert (`expert_rows`), for /metrics and the step log
        self.moe_layers = [module for module in model.modules() if isinstance(module, SparseMoE)]
        for layer in self.moe_layers:  # grouped GEMMs over one stacked copy, not a stack per step
            layer.stack_experts()
        self.expert_rows: torch.Tensor | None = None

    @torch.no_grad()
    def forward(self, batch: FlatBatch, mode: Mode, rows: torch.Tensor) -> torch.Tensor:
        """The logits block this rank owns (`logits.logits_block`: `rows` are its hidden rows, on the
        device): [its sampled rows, its vocab columns]."""
        if self.graphs is not None and self.graphs.applies(batch, mode):  # (never for a mixture of experts)
            return self.graphs(batch, mode, rows)
        if self.compiled is not None and self.compiled.applies(batch, mode):
            out = self.compiled(batch, mode, rows)
        elif self.compiled_mixed is not None and self.compiled_mixed.applies(batch, mode):
            out = self.compiled_mixed(batch, mode, rows)
        else:
            out = self._forward(batch, mode, rows)
        if self.moe_layers:  # the routers' counts of this step (compiled: set by the graph's side effects)
            self.expert_rows = self._expert_rows(mode)
        return out

    def _expert_rows(self, mode: Mode) -> torch.Tensor:
        """(token, choice) rows routed to each expert this step, summed over the MoE layers: every rank
        routes all the tokens in full TP; in SP x TP each sp rank its slice (summed over sp). The rows
        include the step's padding to a multiple of sp (at most sp - 1 tokens)."""
        rows = torch.stack([layer.router_stats[0] for layer in self.moe_layers]).sum(dim=0)
        if mode is Mode.SP_TP and self.mesh.sp.size > 1:
            rows = all_reduce(rows, self.mesh.sp)  # collective: every rank runs the same step
        return rows

    def _forward(self, batch: FlatBatch, mode: Mode, rows: torch.Tensor) -> torch.Tensor:
        token_ids, positions = batch.token_ids, batch.positions
        if mode is Mode.SP_TP and self.mesh.sp.size > 1:  # Ulysses: my contiguous slice of the tokens
            per_rank = token_ids.numel() // self.mesh.sp.size
            first_row = self.mesh.coords.sp * per_rank
            token_ids = token_ids[first_row : first_row + per_rank]
            positions = positions[first_row : first_row + per_rank]
        full_tp = self.full_tp if mode is Mode.TP else None
        backend = PagedAttention(self.cache, batch)
        ops = self.ops
        hidden = self.model.hidden_states(token_ids[None], positions[None], backend, full_tp, ops)[0]
        head = self.model.head_weight if mode is Mode.SP_TP else self.head_view
        return ops.linear(self.model.model.norm(hidden[rows], ops), head)


def _linear_groups(model: Transformer, layers: int = 4) -> list[list[tuple[torch.Tensor, ...]]]:
    """The weights of the first `layers` decoder layers, grouped by input as the forward fuses them
    (Q|K|V, O, gate|up, down): what `PackedWeights.choose_small_rows` times."""
    groups = []
    for layer in list(model.model.layers.values())[:layers]:
        attn, ffn = layer.self_attn, getattr(layer, layer.ffn_name)
        weights = [(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight), (attn.o_proj.weight,)]
        if hasattr(ffn, "gate_proj"):  # a dense MLP (an MoE layer's experts are grouped GEMMs)
            weights += [(ffn.gate_proj.weight, ffn.up_proj.weight), (ffn.down_proj.weight,)]
        groups.append([tuple(w.detach() for w in group) for group in weights])
    return groups
