"""A pure decode step of the model's own layers as one `torch.compile`d graph (inductor): the serving
runner's default; `--enforce-eager` keeps the eager step (docs/serving.md "Compiled decode").

The eager step runs ~300 small ops (norms, RoPE, reshapes, residual adds, ...) at a few microseconds
of dispatch each; inductor fuses them into a few C++ kernels a layer around the GEMMs (extern `mm`).
What is compiled is `Transformer.hidden_states` itself, with the `PLAIN` ops (model/ops.py: `F.linear`,
transformers' RMSNorm) and a paged attention backend whose call is one custom op per layer
(`paged_decode_attention`: cache write, then the CPU kernel or a gather into the cache's kept buffers
and SDPA): inlined, inductor cloned the whole cache per layer for a mutated view, and its
dynamic-context kernels ran 2-4x slower than eager's at 8-64 sequences. The model is an argument of
the compiled function (parameters are graph inputs, not constants: no recompiles, no copies), and the
graph's only dynamic size is the context length, inside the gather index and mask (`warm_up`, at
startup: one compile per batch size). There is no second copy of the model's math to keep in step.
Over a shift group of several ranks the collectives are custom ops inside the graph (comm/ops.py),
and each mode has its own graph: full TP, and SP x TP with its Ulysses all-to-alls (`graph_mode`).

Applies to: a pure decode step (one query per sequence, no stream rotation) of at most `max_seqs`
sequences; on the CPU a dense model in fp32 and the batches where MKL's GEMV, the graph's linear, is
the faster one (the latency case: TPOT one request at a time), on CUDA every batch. Everything else
(prefill and mixed steps: compiled_mixed.py on CUDA) runs the eager step.
"""

from __future__ import annotations

import logging
import os
import time
import types
import weakref

import torch
import torch.nn.functional as F

from shiftlm.model.attention import FullTP
from shiftlm.model.ops import PLAIN
from shiftlm.model.transformer import Transformer
from shiftlm.serve.plan import Mode
from shiftlm.serve.worker.flex_decode import flex_decode, flex_plan
from shiftlm.serve.worker.paged_attention import FlatBatch, PagedAttention, PagedKVCache, kernel_decode

log = logging.getLogger(__name__)
# the batch bound of a dynamic-batch graph: one constant for every instance, since a graph served from
# inductor's cache brings the range it was compiled for
MAX_BATCH = 1 << 16
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
    flex: list[torch.Tensor],
) -> torch.Tensor:
    """The eager decode attention of one layer (PagedAttention's lean path, the same calls): write K/V
    [S, Hkv, D] into `storage` (a `PagedKVCache`'s) at `slots`, attend q [S, Hq, D] -> [S, Hq, D] with
    FlexAttention from the blocks in place where `flex` holds the step's block mask (`flex_plan`), the
    cache's CPU kernel if it has one, else gather the blocks into the cache's kept buffers for SDPA.
    Opaque to inductor: the context length stays inside, so the compiled graph's only dynamic size is
    the batch, and the gather keeps its buffers."""
    cache = _CACHES[storage.data_ptr()]
    cache.write(layer, slots, k, v)
    if flex:
        return flex_decode(q, *cache.slots(layer), flex, cache.block_size)
    if cache.kernel is not None:
        return kernel_decode(cache, layer, q, block_index, positions, window)
    seqs, heads, d = q.shape
    keys, values = cache.gather(layer, block_index, seqs)
    folded = q.reshape(seqs, keys.shape[1], -1, d)
    return F.scaled_dot_product_attention(folded, keys, values, attn_mask=bias).reshape(seqs, heads, d)


@paged_decode_attention.register_fake
def _(q, k, v, storage, layer, slots, block_index, bias, positions, window, flex):
    return torch.empty_like(q)


class DecodeAttention:
    """The attention backend (`model.attention.AttentionBackend`) of a compiled decode step: each
    layer's call is one `paged_decode_attention` on the step's tensors (made inside the graph)."""

    def __init__(self, storage, slots, block_index, bias, positions, window: int, flex: list[torch.Tensor]):
        self.storage, self.slots, self.block_index = storage, slots, block_index
        self.bias, self.positions, self.window, self.flex = bias, positions, window, flex

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [1, S, Hq, D], k/v: [1, S, Hkv, D] -> [1, S, Hq, D]."""
        out = paged_decode_attention(
            q[0],
            k[0],
            v[0],
            self.storage,
            layer,
            self.slots,
            self.block_index,
            self.bias,
            self.positions,
            self.window,
            self.flex,
        )
        return out.unsqueeze(0)


def decode_step(
    model: Transformer,
    ids,
    where,
    positions,
    slots,
    block_index,
    bias,
    rows,
    window,
    storage,
    head,
    full_tp,
    flex_block,
):
    """This rank's block of the sampled rows' logits [rows, its vocab columns] of a decode step: the
    model's own layers with the `PLAIN` ops and `DecodeAttention` (in full TP over the shift group
    where `full_tp` is given), then its final norm and `head` (what `torch.compile` traces). `ids` and
    `where` are the tokens this rank embeds and their positions: every row in full TP, its slice of
    the batch in SP x TP (`sp_slice`; the layers' Ulysses all-to-alls bring every row to attention,
    which reads `positions`, `slots` and the tables of all of them). `flex_block`: the cache's block
    size where attention runs FlexAttention (its block mask is made here, once for every layer),
    else 0."""
    flex = flex_plan(block_index, positions, window, flex_block, storage.shape[2]) if flex_block else []
    backend = DecodeAttention(storage, slots, block_index, bias, positions, window, flex)
    hidden = model.hidden_states(ids[None], where[None], backend, full_tp, PLAIN)[0]
    return F.linear(model.model.norm(hidden[rows], PLAIN), head)


def sp_slice(tensors, rank: int, size: int) -> tuple[torch.Tensor, ...]:
    """Sp rank `rank`'s contiguous slice of each (a batch of a multiple of `size` rows), as fresh
    tensors: what its graph embeds in SP x TP. Sliced outside the graph, so dynamo sees the slice's
    length as a size of its own (no floor division its guards cannot reason about) and no storage
    offset that differs by rank."""
    per_rank = tensors[0].shape[0] // size
    return tuple(t.narrow(0, rank * per_rank, per_rank).clone() for t in tensors)


class ShiftModeSteps:
    """What a compiled step runs with in each shift mode (`CompiledDecode`, `CompiledMixed`): on one
    rank both modes are one computation (full TP's graph); over several, full TP's graph takes every
    row, the sums over the shift group and the LM head rows `head`, and SP x TP's (where `ulysses` =
    (sp rank, sp size) is given) this rank's slice of the rows and its TP shard's whole head."""

    def __init__(
        self,
        model: Transformer,
        full_tp: FullTP | None,
        head: torch.Tensor | None,
        ulysses: tuple[int, int] | None,
    ):
        self.model = model
        self.full_tp = None if full_tp is None or full_tp.group.size == 1 else full_tp
        self.head = model.head_weight if head is None else head
        self.ulysses = ulysses if self.full_tp is not None else None

    def graph_mode(self, mode: Mode) -> Mode | None:
        """The graph a step of `mode` runs: its own mode where the modes differ (several ranks), TP's
        on one rank (the same computation); None where that mode has no compiled step."""
        if self.full_tp is None:
            return Mode.TP
        return mode if mode is Mode.TP or self.ulysses is not None else None

    def mode_inputs(self, mode: Mode, ids: torch.Tensor, positions: torch.Tensor):
        """(token ids and positions this rank embeds, its LM head rows, full TP or None) of a step."""
        if self.graph_mode(mode) is Mode.SP_TP:
            return (*sp_slice((ids, positions), *self.ulysses), self.model.head_weight, None)
        return ids, positions, self.head, self.full_tp


class CompiledDecode(ShiftModeSteps):
    """The compiled decode step of one rank's model and cache; `applies(batch)` says when to use it."""

    def __init__(
        self,
        model: Transformer,
        cache: PagedKVCache,
        max_seqs: int,
        dynamic_batch: bool = False,
        full_tp: FullTP | None = None,
        head: torch.Tensor | None = None,
        ulysses: tuple[int, int] | None = None,
    ):
        """`max_seqs`: the largest batch it runs (on the CPU `ShiftModel` passes the row counts for which
        MKL's GEMV, the graph's extern `mm`, beats oneDNN's packed GEMM that eager uses: compiled was
        1.20x / 1.06x eager's step at 8 / 32 sequences, where eager runs oneDNN).
        `dynamic_batch`: one graph for every batch of 2 to `max_seqs` sequences (the batch a symbolic
        size) and one for a single sequence, instead of one graph per batch size: what a GPU, which
        runs every decode batch compiled, uses.
        `full_tp`: this rank's part of Shift Parallelism's full-TP mode (several ranks: the step's sums
        are collectives the graph keeps (comm/ops.py), and every rank compiles and runs each step in lockstep); `head`: the
        LM head rows this rank computes in full TP (`ShiftModel.head_view`; default the whole head).
        `ulysses` = (sp rank, sp size) where the shift group has several ranks and the model is dense:
        SP x TP decode steps run compiled too (a graph of their own, the TP shard's whole head), else
        they run the eager step."""
        super().__init__(model, full_tp, head, ulysses)
        self.cache, self.max_seqs, self.dynamic_batch = cache, max_seqs, dynamic_batch
        self.dtype = model.model.norm.weight.dtype
        _CACHES[cache.storage.data_ptr()] = cache
        # a code object of its own per model: dynamo keeps at most 8 graphs per code object, so models
        # (tests load several) sharing one would run out
        fn = types.FunctionType(decode_step.__code__.replace(), decode_step.__globals__, "decode_step")
        self._fn = torch.compile(fn, fullgraph=True)
        self.steps = 0  # steps run compiled (tests check the path is taken)

    @staticmethod
    def supports(model: Transformer) -> bool:
        """The models this path covers (else the runner keeps the eager step): a dense model on the CPU
        in fp32 (the GEMV choice is measured in fp32) or on CUDA in any dtype; a mixture of experts in
        bf16 (on either), where its grouped expert GEMMs trace (`torch._grouped_mm`'s meta function
        takes bf16 only) and its routing has no data-dependent size (`moe.expert_counts`)."""
        device, dtype = model.head_weight.device.type, model.model.norm.weight.dtype
        if not (model.with_embedding and model.with_head and device in ("cpu", "cuda")):
            return False
        if model.config.is_moe:
            return dtype == torch.bfloat16
        return device == "cuda" or dtype == torch.float32

    def applies(self, batch: FlatBatch, mode: Mode) -> bool:
        """A pure decode step of at most `max_seqs` sequences (PagedAttention's lean path: row i is
        sequence i, one query each; in SP x TP no padding rows), in a mode with a compiled step."""
        return (
            self.graph_mode(mode) is not None
            and batch.token_ids.shape[0] <= self.max_seqs
            and PagedAttention.is_decode(batch)
        )

    @torch.no_grad()
    def __call__(self, batch: FlatBatch, mode: Mode, rows: torch.Tensor) -> torch.Tensor:
        """This rank's logits block (`logits.logits_block`: `rows` its hidden rows), as
        `ShiftModel.forward` returns it."""
        self.steps += 1
        group = batch.chunks[0]
        bias = group.bias(self.dtype)
        args = (batch.token_ids, batch.positions, batch.slots, group.block_index, bias, rows, group.window)
        return self.run(*args, mode=mode)

    def run(
        self, ids, positions, slots, block_index, bias, rows, window: int, mode: Mode = Mode.TP
    ) -> torch.Tensor:
        """The compiled step of `mode` on these tensors (`decode_step`'s arguments): logits of `rows`."""
        storage = self.cache.storage
        mine, where, head, full_tp = self.mode_inputs(mode, ids, positions)
        flex_block = self.cache.block_size if self.cache.flex else 0
        args = (mine, where, positions, slots, block_index, bias, rows, window, storage, head, full_tp)
        return self._fn(self.model, *args, flex_block)

    def _warm_up_steps(self) -> list[tuple[Mode, int]]:
        """(mode, batch) of each graph `warm_up` compiles: batches 1 to `max_seqs` (or 1 and a dynamic
        one of 2 and up), then in SP x TP the multiples of sp (or sp, a one-row slice a rank, which
        dynamo specializes as it does a size of 1, and a dynamic one of 2 x sp and up)."""
        sizes = [1, 2] if self.dynamic_batch else list(range(1, self.max_seqs + 1))
        steps = [(Mode.TP, seqs) for seqs in sizes if seqs <= self.max_seqs]
        if self.ulysses is not None:
            sp = self.ulysses[1]
            multiples = [sp, 2 * sp] if self.dynamic_batch else range(sp, self.max_seqs + 1, sp)
            steps += [(Mode.SP_TP, seqs) for seqs in multiples if seqs <= self.max_seqs]
        return steps

    @torch.no_grad()
    def warm_up(self) -> bool:
        """Compile now, one graph per batch size it applies to (any context length), on a dummy step
        that writes slots of block 0, then zero the cache; one log line each. False (after one warning
        line) where it cannot be built (inductor fails, or tracing on a platform not tried): the caller
        then runs the eager step, so an untried GPU still serves."""
        device, window = self.cache.storage.device, self.model.config.sliding_window or 0
        announce = int(os.environ.get("RANK", "0")) == 0  # one rank says it, before the wait
        if announce:
            log.info(
                "compiling the decode step for 1-%d sequence(s) (torch.compile, ~15 s each on 2 cores; "
                "--enforce-eager skips this)",
                self.max_seqs,
            )
        for mode, seqs in self._warm_up_steps():
            start = time.perf_counter()
            ulysses = self.graph_mode(mode) is Mode.SP_TP
            dynamic = self.dynamic_batch and seqs > (self.ulysses[1] if ulysses else 1)
            ids = torch.zeros(seqs, dtype=torch.long, device=device)
            slots = torch.arange(seqs, device=device)
            blocks = torch.zeros(2 * seqs, dtype=torch.long, device=device)  # 2 blocks a sequence
            bias = torch.zeros(seqs, 1, 1, 2 * self.cache.block_size, dtype=self.dtype, device=device)
            rows = torch.arange(seqs // self.ulysses[1] if ulysses else seqs, device=device)
            args = (ids, ids.clone(), slots, blocks, bias, rows, window)
            # every context length in one graph per batch size (unbacked: one block, i.e. a size of 1,
            # is not specialized into a graph of its own)
            torch._dynamo.decorators.mark_unbacked(blocks, 0)
            torch._dynamo.decorators.mark_unbacked(bias, 3)
            if dynamic:  # every batch from this one up in this graph (1, and sp in SP x TP, are specialized)
                for tensor in (*args[:3], bias):
                    torch._dynamo.mark_dynamic(tensor, 0, min=seqs, max=MAX_BATCH)
                if ulysses:  # the rows of this rank's slice that are sampled: any count
                    torch._dynamo.decorators.mark_unbacked(rows, 0)
                else:
                    torch._dynamo.mark_dynamic(rows, 0, min=2, max=MAX_BATCH)
            try:
                self.run(*args, mode=mode)
            except Exception as err:  # noqa: BLE001 - inductor, or tracing on an untried platform
                log.warning(
                    "the compiled decode step could not be built (%s: %s); decoding eagerly",
                    type(err).__name__,
                    (str(err).splitlines() or [""])[0],
                )
                self.cache.storage.zero_()
                return False
            if announce:
                what = f"{seqs}-{self.max_seqs}" if dynamic else str(seqs)
                log.info(
                    "compiled the %s decode step of %s sequence(s) in %.1f s",
                    mode.name if self.full_tp is not None else "",
                    what,
                    time.perf_counter() - start,
                )
        self.cache.storage.zero_()
        return True
