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

`capture=False` runs the same padded step without graphs: the CPU tests check it against the eager
step (tests/serve/test_decode_graphs.py); the `cuda`-marked test captures on a GPU.
"""

from __future__ import annotations

import logging
import time

import torch

from shiftlm.serve.worker.compiled_step import CompiledDecode
from shiftlm.serve.worker.paged_attention import FlatBatch, PagedAttention

log = logging.getLogger(__name__)


def capture_sizes(max_seqs: int) -> list[int]:
    """vLLM's padded batch sizes: 1, 2, 4, 8, then steps of 8, up to (and including) `max_seqs`."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_seqs]
    sizes += list(range(8 if max_seqs > 8 else max_seqs, max_seqs, 8)) if max_seqs > 8 else []
    return sorted({*sizes, max_seqs})


def context_buckets(max_blocks: int) -> list[int]:
    """Blocks per sequence a graph is captured for: powers of two up to `max_blocks` (and it)."""
    buckets, blocks = [], 1
    while blocks < max_blocks:
        buckets.append(blocks)
        blocks *= 2
    return [*buckets, max_blocks]


class DecodeGraphs:
    """The decode steps of one rank's compiled step, padded to captured shapes (CUDA graphs on a GPU)."""

    def __init__(self, compiled: CompiledDecode, max_seqs: int, max_blocks: int, capture: bool):
        cache = compiled.cache
        if cache.scratch_block is None:
            raise ValueError("decode graphs pad with a scratch block: build the cache with scratch=True")
        self.compiled, self.cache, self.capture = compiled, cache, capture
        self.sizes, self.buckets = capture_sizes(max_seqs), context_buckets(max_blocks)
        # the shapes that get a graph: at most the cache's blocks gathered per layer. FlexAttention reads
        # each sequence's own blocks in place, whatever the table's width: one bucket, the longest
        if cache.flex:
            self.buckets = [max_blocks]
        self.shapes = frozenset(
            (s, b) for s in self.sizes for b in self.buckets if cache.flex or s * b <= cache.num_blocks
        )
        device, block = cache.storage.device, cache.block_size
        self.scratch_slot = cache.scratch_block * block
        most = self.sizes[-1]
        self.ids = torch.zeros(most, dtype=torch.long, device=device)
        self.positions = torch.zeros(most, dtype=torch.long, device=device)
        self.slots = torch.full((most,), self.scratch_slot, dtype=torch.long, device=device)
        self.rows = torch.arange(most, device=device)
        self.window = compiled.model.config.sliding_window or 0
        self._inputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # every graph writes its logits here (one buffer for all: the graphs' own outputs are freed)
        self._logits: torch.Tensor | None = None
        self.steps = 0  # steps run through this path (tests check it is taken)

    def applies(self, batch: FlatBatch) -> bool:
        """A pure decode step whose padded shape has a graph (on the CPU: would have one)."""
        seqs = batch.token_ids.shape[0]
        if not (PagedAttention.is_decode(batch) and batch.num_tokens == seqs and seqs <= self.sizes[-1]):
            return False
        context = batch.chunks[0].block_index.numel() // seqs
        return context <= self.buckets[-1] and self._shape(seqs, context) in self.shapes

    def _shape(self, seqs: int, context: int) -> tuple[int, int]:
        return next(s for s in self.sizes if s >= seqs), next(b for b in self.buckets if b >= context)

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

    def _run(self, size: int, blocks: int) -> torch.Tensor:
        tables, bias = self._buffers(size, blocks)
        args = (self.ids[:size], self.positions[:size], self.slots[:size], tables, bias, self.rows[:size])
        return self.compiled.run(*args, self.window)

    @torch.no_grad()
    def __call__(self, batch: FlatBatch) -> torch.Tensor:
        """The sampled rows' logits [samples, padded vocab], as `ShiftModel.forward` returns them."""
        self.steps += 1
        seqs, group = batch.token_ids.shape[0], batch.chunks[0]
        context = group.block_index.numel() // seqs
        size, blocks = self._shape(seqs, context)
        tables, bias = self._buffers(size, blocks)
        self.ids[:seqs].copy_(batch.token_ids)
        self.positions[:seqs].copy_(batch.positions)
        self.slots[:seqs].copy_(batch.slots)
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
        graph = self._graphs.get((size, blocks))
        if graph is not None:
            graph.replay()
            out = self._logits[:size]
        else:
            out = self._run(size, blocks)
        return out[batch.sample_rows]

    @torch.no_grad()
    def capture_all(self) -> None:
        """Capture a graph per (size, bucket) on a GPU (no-op without `capture`); one log line."""
        if not self.capture:
            return
        start = time.perf_counter()
        if not self.cache.flex:  # the gather buffers at their largest: no graph's memory moves
            self.cache.reserve_gather(max(size * blocks for size, blocks in self.shapes))
        pool = torch.cuda.graph_pool_handle()
        for size, blocks in sorted(self.shapes, reverse=True):  # largest first: the rest reuse its pool
            warm = self._run(size, blocks)  # compiled kernels built, caches touched, outside capture
            if self._logits is None:
                self._logits = warm.new_empty(self.sizes[-1], warm.shape[1])
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[:size].copy_(self._run(size, blocks))
            self._graphs[size, blocks] = graph
        self.cache.storage.zero_()
        log.info(
            "captured %d CUDA graphs (batch sizes %s x context buckets of %s blocks, at most the cache's "
            "blocks gathered) in %.1f s",
            len(self._graphs),
            self.sizes,
            self.buckets,
            time.perf_counter() - start,
        )
