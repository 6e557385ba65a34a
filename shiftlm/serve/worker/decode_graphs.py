"""Decode steps replayed from CUDA graphs captured at startup (issue 34 item 2; vLLM's way).

A compiled decode step (compiled_step.py) still launches every kernel from Python, one by one; a CUDA
graph replays the whole step's kernels with one call. A graph fixes its shapes and its memory, so each
is captured for a padded batch size (vLLM's sizes: 1, 2, 4, 8, then steps of 8 up to `max_seqs`)
and a context bucket (a power of two of blocks, up to the longest sequence), over inputs that live in
persistent buffers:

- a step of S sequences whose longest context takes C blocks runs the graph of the smallest size >= S
  and the smallest bucket >= C; its token ids, positions, slots, block tables and mask are copied into
  that graph's buffers, and the rows past S are padding;
- a padding row writes its K/V to a scratch block that no sequence owns (`PagedKVCache(scratch=True)`)
  and attends to it alone; a real row's table past its own blocks names the scratch block, masked out;
- the attention op's gather buffers are reserved at their largest before the first capture, so that
  no graph's memory moves under another one; a shape whose padded context would gather more blocks
  than the cache holds gets no graph (such a step runs compiled, without one), which bounds those
  buffers by one layer's share of the cache.

Several ranks (Shift Parallelism's shift group): every rank captures the same shapes in the same order
(the runner agrees on the cache's blocks), the collectives inside are NCCL's, captured with the rest.
Where the modes differ each has its own graphs (as ArcticInference captures per mode): full TP's at
vLLM's sizes, SP x TP's at those sizes rounded up to a multiple of sp, since each sp rank embeds its
contiguous slice of the padded batch. So that the logits every rank computes are the rows the gather
expects, an SP x TP decode's batch is padded to its graph's size before the step (`padded`).

`capture=False` runs the same padded step without graphs: the CPU tests check it against the eager
step (tests/serve/test_decode_graphs.py); the `cuda`-marked test captures on a GPU.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from shiftlm.serve.plan import Mode
from shiftlm.serve.worker.compiled_step import CompiledDecode
from shiftlm.serve.worker.flex_decode import padded_batch
from shiftlm.serve.worker.paged_attention import FlatBatch, PagedAttention

log = logging.getLogger(__name__)


def capture_sizes(max_seqs: int, requested: tuple[int, ...] = ()) -> list[int]:
    """The padded batch sizes graphs are captured for, as vLLM's `--cuda-graph-sizes` reads
    `requested`: none, 1, 2, 4, 8, then steps of 8, up to (and including) `max_seqs`; one value N,
    that pattern up to N; several, exactly those (each at most `max_seqs`)."""
    if len(requested) > 1:
        return sorted({size for size in requested if size <= max_seqs})
    largest = min(requested[0], max_seqs) if requested else max_seqs
    return sorted(
        {padded_batch(seqs) for seqs in range(1, largest) if padded_batch(seqs) < largest} | {largest}
    )


def context_buckets(max_blocks: int) -> list[int]:
    """Blocks per sequence a graph is captured for: powers of two up to `max_blocks` (and it)."""
    buckets, blocks = [], 1
    while blocks < max_blocks:
        buckets.append(blocks)
        blocks *= 2
    return [*buckets, max_blocks]


class DecodeGraphs:
    """The decode steps of one rank's compiled step, padded to captured shapes (CUDA graphs on a GPU)."""

    def __init__(
        self,
        compiled: CompiledDecode,
        max_seqs: int,
        max_blocks: int,
        capture: bool,
        requested: tuple[int, ...] = (),
    ):
        cache = compiled.cache
        if cache.scratch_block is None:
            raise ValueError("decode graphs pad with a scratch block: build the cache with scratch=True")
        self.compiled, self.cache, self.capture = compiled, cache, capture
        self.sizes = {Mode.TP: capture_sizes(max_seqs, requested)}  # requested: --cuda-graph-sizes
        if compiled.ulysses is not None:  # SP x TP's own graphs: batches of whole sp slices
            sp = compiled.ulysses[1]
            self.sizes[Mode.SP_TP] = sorted({-(-size // sp) * sp for size in self.sizes[Mode.TP]})
        self.buckets = context_buckets(max_blocks)
        # the shapes that get a graph: at most the cache's blocks gathered per layer. FlexAttention reads
        # each sequence's own blocks in place, whatever the table's width: one bucket, the longest
        if cache.flex:
            self.buckets = [max_blocks]
        self.shapes = frozenset(
            (mode, s, b)
            for mode, sizes in self.sizes.items()
            for s in sizes
            for b in self.buckets
            if cache.flex or s * b <= cache.num_blocks
        )
        device, block = cache.storage.device, cache.block_size
        self.scratch_slot = cache.scratch_block * block
        most = max(sizes[-1] for sizes in self.sizes.values())
        self.ids = torch.zeros(most, dtype=torch.long, device=device)
        self.positions = torch.zeros(most, dtype=torch.long, device=device)
        self.slots = torch.full((most,), self.scratch_slot, dtype=torch.long, device=device)
        self.rows = torch.arange(most, device=device)
        self.window = compiled.model.config.sliding_window or 0
        self._inputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._graphs: dict[tuple[Mode, int, int], torch.cuda.CUDAGraph] = {}
        # every graph of a mode writes its logits here (one buffer per mode: the graphs' own outputs
        # are freed)
        self._logits: dict[Mode, torch.Tensor] = {}
        self.steps = 0  # steps run through this path (tests check it is taken)

    def applies(self, batch: FlatBatch, mode: Mode) -> bool:
        """A pure decode step whose padded shape has a graph (on the CPU: would have one)."""
        mode = self.compiled.graph_mode(mode)
        seqs = PagedAttention.decode_rows(batch)
        if mode not in self.sizes or not 0 < seqs <= self.sizes[mode][-1]:
            return False
        context = batch.chunks[0].block_index.numel() // seqs
        return context <= self.buckets[-1] and (mode, *self._shape(mode, seqs, context)) in self.shapes

    def padded(self, batch: FlatBatch, mode: Mode) -> FlatBatch:
        """`batch` as its graph runs it: an SP x TP decode padded to the graph's batch size (each sp
        rank's slice is then the graph's, and the logits gather reads the same rows); else as is."""
        if self.compiled.graph_mode(mode) is not Mode.SP_TP or not self.applies(batch, mode):
            return batch
        seqs = PagedAttention.decode_rows(batch)
        context = batch.chunks[0].block_index.numel() // seqs
        size, _ = self._shape(Mode.SP_TP, seqs, context)
        extra = size - batch.token_ids.shape[0]
        if extra == 0:
            return batch
        zeros = batch.token_ids.new_zeros(extra)
        return replace(
            batch,
            token_ids=torch.cat((batch.token_ids, zeros)),
            positions=torch.cat((batch.positions, zeros)),
            slots=torch.cat((batch.slots, zeros - 1)),  # padding rows: no slot (FlatBatch's convention)
        )

    def _shape(self, mode: Mode, seqs: int, context: int) -> tuple[int, int]:
        size = next(s for s in self.sizes[mode] if s >= seqs)
        return size, next(b for b in self.buckets if b >= context)

    def _rows(self, mode: Mode, size: int) -> int:
        """The hidden rows a graph of `size` sequences computes logits for on this rank."""
        return size // self.compiled.ulysses[1] if mode is Mode.SP_TP else size

    def _buffers(self, size: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block tables [size * blocks], additive mask [size, 1, 1, blocks * block_size]) of one shape:
        rows of scratch blocks, each reading its first slot only (what a padding row attends to)."""
        key = (size, blocks)
        if key not in self._inputs:
            device, dtype = self.cache.storage.device, self.compiled.dtype
            tables = torch.full((size * blocks,), self.cache.scratch_block, dtype=torch.long, device=device)
            bias = torch.full(
                (size, 1, 1, blocks * self.cache.block_size), float("-inf"), dtype=dtype, device=device
            )
            bias[..., 0] = 0
            self._inputs[key] = (tables, bias)
        return self._inputs[key]

    def _run(self, mode: Mode, size: int, blocks: int) -> torch.Tensor:
        tables, bias = self._buffers(size, blocks)
        rows = self.rows[: self._rows(mode, size)]
        args = (self.ids[:size], self.positions[:size], self.slots[:size], tables, bias, rows)
        return self.compiled.run(*args, self.window, mode=mode)

    @torch.no_grad()
    def __call__(self, batch: FlatBatch, mode: Mode, rows: torch.Tensor) -> torch.Tensor:
        """This rank's logits block (`rows`: its hidden rows, of the `padded` batch), as
        `ShiftModel.forward` returns it."""
        self.steps += 1
        mode = self.compiled.graph_mode(mode)
        seqs, group = PagedAttention.decode_rows(batch), batch.chunks[0]
        context = group.block_index.numel() // seqs
        size, blocks = self._shape(mode, seqs, context)
        tables, bias = self._buffers(size, blocks)
        self.ids[:seqs].copy_(batch.token_ids[:seqs])
        self.positions[:seqs].copy_(batch.positions[:seqs])
        self.slots[:seqs].copy_(batch.slots[:seqs])
        self.ids[seqs:size].zero_()
        self.positions[seqs:size].zero_()
        self.slots[seqs:size].fill_(self.scratch_slot)
        table = tables.view(size, blocks)
        table[:seqs, :context].copy_(group.block_index.view(seqs, context))
        table[:seqs, context:].fill_(self.cache.scratch_block)
        table[seqs:].fill_(self.cache.scratch_block)
        if not self.cache.flex:  # FlexAttention reads the positions, not the mask
            width = context * self.cache.block_size
            bias[:seqs, ..., :width].copy_(group.bias(bias.dtype))
            bias[:seqs, ..., width:].fill_(float("-inf"))
            bias[seqs:].fill_(float("-inf"))
            bias[seqs:, ..., 0] = 0
        graph = self._graphs.get((mode, size, blocks))
        if graph is not None:
            graph.replay()
            out = self._logits[mode][: self._rows(mode, size)]
        else:
            out = self._run(mode, size, blocks)
        return out[rows]

    @torch.no_grad()
    def capture_all(self) -> None:
        """Capture a graph per (size, bucket) on a GPU (no-op without `capture`); one log line."""
        if not self.capture:
            return
        start = time.perf_counter()
        if not self.cache.flex:  # the gather buffers at their largest: no graph's memory moves
            # kept here: an eager step's larger gather later replaces the cache's buffer, and without
            # this reference the graphs would gather into freed memory
            self._gather_buffer = self.cache.reserve_gather(
                max(size * blocks for _, size, blocks in self.shapes)
            )
        pool = torch.cuda.graph_pool_handle()
        # largest first (the rest reuse its pool), in the same order on every rank of the group
        for mode, size, blocks in sorted(
            self.shapes, key=lambda shape: (shape[1], shape[2], shape[0].value), reverse=True
        ):
            warm = self._run(mode, size, blocks)  # compiled kernels built, caches touched, outside capture
            if mode not in self._logits:
                self._logits[mode] = warm.new_empty(self._rows(mode, self.sizes[mode][-1]), warm.shape[1])
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[mode][: self._rows(mode, size)].copy_(self._run(mode, size, blocks))
            self._graphs[mode, size, blocks] = graph
        self.cache.storage.zero_()
        log.info(
            "captured %d CUDA graphs (batch sizes %s x context buckets of %s blocks, at most the cache's "
            "blocks gathered) in %.1f s",
            len(self._graphs),
            {mode.name: sizes for mode, sizes in self.sizes.items()},
            self.buckets,
            time.perf_counter() - start,
        )
