"""Deterministic, resumable batches from token shards; each DP rank reads only its share.

A sample is a window of `seq_len + 1` tokens (inputs and next-token targets) taken at stride
`seq_len` inside one shard. The order of samples is a seeded permutation per epoch, so the sample at
global position p is a pure function of (seed, p): the data position in a checkpoint is just the
number of samples consumed, and any layout reads the same global batch at the same step. Step s
owns positions [s*G, (s+1)*G) for global batch G; DP rank d reads the d-th contiguous block of
G/dp positions and splits it into micro-batches, memory-mapping only those windows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shiftlm.train.sources import DataError, shard_dtype


class TokenDataset:
    """Windows of `seq_len + 1` tokens over memory-mapped shards."""

    def __init__(self, shards: list[Path], seq_len: int):
        self.seq_len = seq_len
        self._shards = [np.memmap(path, dtype=shard_dtype(path), mode="r") for path in shards]
        counts = [max(0, (len(tokens) - 1) // seq_len) for tokens in self._shards]
        self._starts = np.cumsum([0, *counts])
        if self._starts[-1] == 0:
            total = sum(len(tokens) for tokens in self._shards)
            raise DataError(
                f"the dataset has {total} tokens, fewer than one sample of seq_len + 1 = {seq_len + 1}; "
                "add data or lower train.seq_len"
            )

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> np.ndarray:
        shard = int(np.searchsorted(self._starts, index, side="right")) - 1
        offset = (index - int(self._starts[shard])) * self.seq_len
        return np.asarray(self._shards[shard][offset : offset + self.seq_len + 1], dtype=np.int64)


class SampleRange:
    """Samples [start, stop) of a dataset, renumbered from 0: the training set and its held-out tail."""

    def __init__(self, dataset: TokenDataset, start: int, stop: int):
        self.dataset, self.start, self.stop = dataset, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int) -> np.ndarray:
        return self.dataset[self.start + index]


def split_holdout(dataset: TokenDataset, holdout: int) -> tuple[SampleRange, SampleRange]:
    """(training samples, the last `holdout` samples): the held-out tail is never trained on."""
    total = len(dataset)
    if holdout and holdout * 2 > total:
        raise DataError(
            f"validation holds out {holdout} samples (validation.steps x train.global_batch) but the "
            f"dataset has only {total}: lower validation.steps, or add data"
        )
    return SampleRange(dataset, 0, total - holdout), SampleRange(dataset, total - holdout, total)


class SampleOrder:
    """Global position -> sample index: a fresh seeded permutation of the dataset each epoch."""

    def __init__(self, num_samples: int, seed: int):
        self.num_samples = num_samples
        self.seed = seed
        self._epoch, self._permutation = -1, np.empty(0, dtype=np.int64)

    def __getitem__(self, position: int) -> int:
        epoch, within = divmod(position, self.num_samples)
        if epoch != self._epoch:
            self._epoch = epoch
            self._permutation = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        return int(self._permutation[within])


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's global batch is split: G = dp x accumulation x micro_batch."""

    global_batch: int
    micro_batch: int
    dp_size: int

    @property
    def accumulation(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp_size)

    def positions(self, step: int, dp_rank: int) -> list[list[int]]:
        """The global sample positions of each of this DP rank's micro-batches at `step`."""
        share = self.global_batch // self.dp_size
        first = step * self.global_batch + dp_rank * share
        return [
            list(range(first + m * self.micro_batch, first + (m + 1) * self.micro_batch))
            for m in range(self.accumulation)
        ]


class BatchReader:
    """Micro-batches of (inputs, targets) int64 arrays, shape [micro_batch, seq_len], for one DP rank."""

    def __init__(self, dataset: TokenDataset | SampleRange, plan: BatchPlan, dp_rank: int, seed: int):
        self.dataset, self.plan, self.dp_rank = dataset, plan, dp_rank
        self.order = SampleOrder(len(dataset), seed)

    def step(self, step: int) -> list[tuple[np.ndarray, np.ndarray]]:
        micro_batches = []
        for positions in self.plan.positions(step, self.dp_rank):
            windows = np.stack([self.dataset[self.order[p]] for p in positions])
            if windows.ndim == 3:  # multi-stream samples (train/streams.py): ids, targets, tags
                micro_batches.append((windows[..., 0], windows[..., 1], windows[..., 2:]))
            else:
                micro_batches.append((windows[:, :-1], windows[:, 1:]))
        return micro_batches
