"""Data-parallel gradient sync with bucketing and overlap (Li et al. 2020, PyTorch DDP, §3.2).

Gradients are summed (not averaged: the loss is already divided by the global token count) over
the group of ranks that hold the same parameters. Buckets are contiguous slices of the flat
gradient buffer, filled in reverse parameter order, which is roughly the order backward produces
them. A post-accumulate hook counts each parameter's gradient arrivals; when every parameter of a
bucket has received all of this step's micro-batches, the bucket's all-reduce starts asynchronously
while backward goes on. Gradients that autograd does not accumulate (the pipeline executor assigns
them) are announced with `parameters_ready`, which the trainer calls from the executor's per-stage
callback, so with a pipeline a stage's buckets are reduced while later actions of the schedule run.
`finish()` starts whatever is left and waits for all of them. Every rank of the group runs the
same backward (or schedule), so buckets start in the same order everywhere, as collectives must.
With `overlap=False` all buckets start in `finish()`; the sums are the same bit for bit.
ZeRO-2/3 keep sharded gradients instead (`grad_shards.ShardedGrads`, the same interface).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shiftlm.comm import CommGroup, all_reduce, tree_all_reduce
from shiftlm.train.flat import FlatParameters, hook_arrivals

DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024


class GradSync:
    def __init__(
        self,
        flat: FlatParameters,
        group: CommGroup,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        overlap: bool = True,
        count_accumulations: bool = True,
        groups: list[CommGroup] | None = None,
        deterministic: bool = False,
    ):
        """`count_accumulations=False`: ignore autograd's accumulate hooks, only `parameters_ready`
        completes a parameter (the pipeline executor: its I pass fires a weight's hook without a
        gradient, whose W comes later). `groups[i]`: parameter i's data group when they differ
        (routed experts over `edp`, train/moe.py); a bucket never spans two groups. `deterministic`
        (`train.deterministic`): every bucket summed by `tree_all_reduce` in `finish()`, no overlap."""
        self.flat, self.group, self.deterministic = flat, group, deterministic
        overlap = overlap and not deterministic
        self.groups = groups if groups is not None else [group] * len(flat.parameters)
        self.overlap = overlap and max((g.size for g in self.groups), default=1) > 1
        self.buckets: list[tuple[int, int]] = []  # [start, end) in the flat buffer
        self._bucket_group: list[CommGroup] = []
        self._bucket_of: list[int] = []  # parameter index -> bucket index
        self._build_buckets(bucket_bytes // 4)
        self._expected = 0
        self._arrivals = [0] * len(flat.parameters)
        self._done = [False] * len(flat.parameters)
        self._pending = [0] * len(self.buckets)  # parameters still to arrive, per bucket
        self._handles: dict[int, dist.Work | None] = {}
        if self.overlap and count_accumulations:
            hook_arrivals(flat, self._arrived)

    def _build_buckets(self, bucket_elements: int) -> None:
        self._bucket_of = [0] * len(self.flat.slots)
        end, start = None, None
        for index in reversed(range(len(self.flat.slots))):
            slot = self.flat.slots[index]
            if end is None:
                end = slot.offset + slot.numel
            start = slot.offset
            self._bucket_of[index] = len(self.buckets)
            boundary = index == 0 or self.groups[index - 1] is not self.groups[index]
            if end - start >= bucket_elements or boundary:
                self.buckets.append((start, end))
                self._bucket_group.append(self.groups[index])
                end = None

    def begin_step(self, micro_batches: int) -> None:
        """Arm the hooks: each parameter will receive `micro_batches` gradient contributions."""
        self._expected = micro_batches
        self._arrivals = [0] * len(self.flat.parameters)
        self._done = [False] * len(self.flat.parameters)
        self._pending = [0] * len(self.buckets)
        for bucket in self._bucket_of:
            self._pending[bucket] += 1
        self._handles = {}

    def _arrived(self, index: int) -> None:
        self._arrivals[index] += 1
        if self._arrivals[index] == self._expected:
            self._complete(index)

    def _complete(self, index: int) -> None:
        if self._done[index]:
            return
        self._done[index] = True
        bucket = self._bucket_of[index]
        self._pending[bucket] -= 1
        if self._pending[bucket] == 0:
            self._launch(bucket)

    @property
    def started_buckets(self) -> int:
        """Buckets whose all-reduce has started this step."""
        return len(self._handles)

    def parameters_ready(self, indices: list[int]) -> None:
        """These parameters' gradients (in the flat buffer) are final for this step: start every
        bucket they complete. Without overlap this does nothing and `finish()` starts them all."""
        if self.overlap:
            for index in indices:
                self._complete(index)

    def _launch(self, bucket: int) -> None:
        start, end = self.buckets[bucket]
        chunk = self.flat.grads[start:end]
        if self.deterministic:
            chunk.copy_(tree_all_reduce(chunk, self._bucket_group[bucket]))
            self._handles[bucket] = None
            return
        self._handles[bucket] = all_reduce(chunk, self._bucket_group[bucket], async_op=True, in_place=True)

    @torch.no_grad()
    def finish(self) -> None:
        """All gradients are summed over the group when this returns."""
        if all(group.size == 1 for group in self._bucket_group):
            return
        for bucket in range(len(self.buckets)):  # in bucket order on every rank: same collective order
            if bucket not in self._handles:
                self._launch(bucket)
        for handle in self._handles.values():
            if handle is not None:
                handle.wait()
        self._expected = 0
