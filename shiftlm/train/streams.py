"""Training on multi-stream samples (the Multi-Stream LLMs recipe): `data.format = "streams"`.

`data.source` is a JSONL file, one sample a line: {"prefix": text, "streams": [text, ...]}. A sample is
laid out as serving lays out a `timestep` stream group (`model.stream_mask.interleave`): the prefix,
then timestep by timestep one token of every stream that has one; token t of a stream has position
prefix_len + t, and the attention mask is `stream_visibility(TIMESTEP, ...)`, the very function the
serving engine builds its masks with. A stream token's target is the next token of the same stream;
the prefix, each stream's first token (no row predicts it: in serving it is the stream's given input)
and each stream's last token have none (-100). A sample longer than `train.seq_len` keeps its first
timesteps; a shorter one is padded with tokens that nothing reads and no loss counts.

Layouts: dp, tp (with or without Megatron sequence parallelism) and pp (every schedule). Ulysses
(sp > 1) and context parallelism (cp > 1) are refused: they split the sequence across ranks, the
Ulysses / ring code derives positions and causality from the split (`ring_attention.sequence_indices`,
zigzag causal blocks), and neither carries an arbitrary [S, S] mask yet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shiftlm.errors import ConfigError
from shiftlm.model.loss import IGNORE_INDEX
from shiftlm.model.ops import PLAIN, Ops
from shiftlm.model.stream_mask import PROMPT, TIMESTEP, MaskedAttention, interleave, stream_visibility
from shiftlm.train.sources import DataError

FORMATS = ("text", "streams")
FIELDS = 4  # per token: input id, target, stream, position


def check_data_format(config) -> None:
    """One line naming the problem, before any rank starts."""
    data, parallel = config.data, config.parallel
    if data.format not in FORMATS:
        raise ConfigError(f"data.format = {data.format!r}; choose one of {', '.join(FORMATS)}")
    if data.format == "streams" and (parallel.sp > 1 or parallel.cp > 1):
        raise ConfigError(
            "data.format = 'streams' trains with dp, tp and pp only (Ulysses and ring attention split the "
            "sequence and take causality from the split, not the streams' mask); set parallel.sp = 1 and "
            "parallel.cp = 1"
        )


def stream_sample(prefix: list[int], streams: list[list[int]], seq_len: int) -> np.ndarray:
    """One sample as [seq_len, 4] int64: (input id, target, stream, position) per token."""
    lengths = [len(s) for s in streams]
    while len(prefix) + sum(lengths) > seq_len:  # keep the first timesteps
        if max(lengths) <= 1:
            raise DataError(
                f"a sample's prefix has {len(prefix)} tokens: too long for train.seq_len = {seq_len}"
            )
        lengths = [min(n, max(lengths) - 1) for n in lengths]
    tags_stream, tags_pos = interleave(len(prefix), lengths)
    ids, targets = list(prefix), [IGNORE_INDEX] * len(prefix)
    for stream, position in zip(tags_stream[len(prefix) :], tags_pos[len(prefix) :]):
        t = position - len(prefix)
        ids.append(streams[stream][t])
        targets.append(streams[stream][t + 1] if t + 1 < lengths[stream] else IGNORE_INDEX)
    pad = seq_len - len(ids)
    end = len(prefix) + max(lengths, default=0)  # padding sits past every real position: unread
    out = np.empty((seq_len, FIELDS), dtype=np.int64)
    out[:, 0] = ids + [0] * pad
    out[:, 1] = targets + [IGNORE_INDEX] * pad
    out[:, 2] = tags_stream + [PROMPT] * pad
    out[:, 3] = tags_pos + list(range(end, end + pad))
    return out


class StreamSamples:
    """The dataset of a `streams` JSONL file, tokenized once: item i is `stream_sample`'s array."""

    def __init__(self, path: str | Path, tokenizer, seq_len: int):
        self.samples = []
        path = Path(path)
        if not path.is_file():
            raise DataError(
                f"data.source {str(path)!r} is not a file; data.format = 'streams' reads one JSONL file"
            )
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                prefix, streams = record["prefix"], record["streams"]
                assert isinstance(prefix, str) and streams and all(isinstance(s, str) for s in streams)
            except (json.JSONDecodeError, KeyError, TypeError, AssertionError):
                raise DataError(
                    f'{path}:{number}: expected {{"prefix": text, "streams": [text, ...]}} (non-empty streams)'
                ) from None
            encoded = [tokenizer.encode(s).ids for s in streams]
            self.samples.append(stream_sample(tokenizer.encode(prefix).ids, encoded, seq_len))
        if not self.samples:
            raise DataError(f"{path} has no samples")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.samples[index]


@dataclass(frozen=True)
class StreamContext:
    """What the layers need for a micro-batch of stream samples: RoPE positions and the mask."""

    positions: torch.Tensor  # [B, S]
    backend: MaskedAttention


def stream_context(tags: np.ndarray, device: torch.device | str = "cpu") -> StreamContext:
    """From the (stream, position) tags [B, S, 2] of a micro-batch."""
    tags = torch.as_tensor(np.ascontiguousarray(tags), device=device)
    streams, positions = tags[..., 0], tags[..., 1]
    mask, _ = stream_visibility(TIMESTEP, streams, positions, streams, positions)
    return StreamContext(positions, MaskedAttention(mask))


class StreamStage(torch.nn.Module):
    """A pipeline stage run with its micro-batch's positions and mask: the executor sets
    `micro_batch` before each forward (pipeline/executor.py); `contexts` are the step's."""

    def __init__(self, stage):
        super().__init__()
        self.stage = stage
        self.micro_batch = 0
        self.contexts: list[StreamContext] = []

    def forward(self, x: torch.Tensor, ops: Ops = PLAIN) -> torch.Tensor:
        context = self.contexts[self.micro_batch]
        return self.stage(x, context.positions, context.backend, ops=ops)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.stage.loss(logits, targets)
