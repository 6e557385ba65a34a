"""Test doubles for the model: a runner whose 'K/V cache' stores token ids in the engine's slots."""

from __future__ import annotations

from dataclasses import replace

import torch

from shiftlm.model.stream_mask import ISOLATED
from shiftlm.serve.plan import PENDING, StepPlan

VOCAB = 32
EOS = 31


def next_token_scores(context: list[int]) -> torch.Tensor:
    """Logits that depend on every token of the context and its order (a stand-in for a model)."""
    mix = 0
    for position, token in enumerate(context):
        mix = (mix * 31 + (position + 1) * (token + 7)) % 1_000_003
    generator = torch.Generator().manual_seed(mix)
    return torch.randn(VOCAB, generator=generator) * 3


def reference_greedy(prompt: list[int], max_tokens: int, eos: int | None = None) -> list[int]:
    context, output = list(prompt), []
    while len(output) < max_tokens:
        token = int(torch.argmax(next_token_scores(context)))
        output.append(token)
        context.append(token)
        if token == eos:
            break
    return output


class SlotRunner:
    """Writes each scheduled token into its cache slot and reads the whole context back through the
    block table, so a wrong block table, a shared block overwritten or a lost slot changes the output."""

    def __init__(self, num_blocks: int, block_size: int, scores=next_token_scores):
        self.scores = scores  # context -> next-token logits (the stand-in model)
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.plans: list[StepPlan] = []
        self.tables: dict[int, list[int]] = {}  # batch row -> block table, kept from the plans' deltas
        self.streams: list[int] = [-1] * (num_blocks * block_size)  # stream-group tag of each slot
        self.ahead = 0  # steps run ahead of the previous step's tokens (async scheduling)
        self.events: list | None = None  # ("execute", step) per call, where a test records the order

    def slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    runs_ahead = True  # takes a plan's PENDING tokens from the previous step's draws (async scheduling)

    def execute(self, plan: StepPlan, pending: torch.Tensor | None = None) -> torch.Tensor:
        self.ahead += pending is not None
        if self.events is not None:
            self.events.append(("execute", plan.step))
        if pending is not None:  # fill them in, in the plan's order, as the model runner does
            fill = iter(pending.tolist())
            chunks = [
                replace(c, token_ids=tuple(next(fill) if t == PENDING else t for t in c.token_ids))
                for c in plan.chunks
            ]
            assert next(fill, None) is None, "more pending tokens than the plan has PENDING entries"
            plan = replace(plan, chunks=tuple(chunks))
        assert all(t != PENDING for c in plan.chunks for t in c.token_ids), "a PENDING token not filled in"
        self.plans.append(plan)
        for chunk in plan.chunks:
            table = self.tables.setdefault(chunk.row, [])
            table[chunk.first_block :] = chunk.new_blocks
        for chunk in plan.chunks:
            for offset, token in enumerate(chunk.token_ids):
                slot = self.slot(self.tables[chunk.row], chunk.start + offset)
                self.slots[slot] = token
                self.streams[slot] = chunk.streams[offset] if chunk.layout else -1
        rows = []
        for chunk in plan.chunks:  # the rows the real runner returns: sampled ones, every row of echo chunks
            if not chunk.num_logits_rows:
                continue
            last = chunk.start + len(chunk.token_ids)
            for end in range(last - chunk.num_logits_rows + 1, last + 1):
                rows.append(self.scores(self.context(chunk, end)))
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)

    def context(self, chunk, end: int) -> list[int]:
        """The tokens the row before `end` reads: all of them, or in an isolated stream group
        (OpenAI's n samples) the prompt and the row's own stream."""
        slots = [self.slot(self.tables[chunk.row], p) for p in range(end)]
        if chunk.layout:
            assert chunk.layout == ISOLATED, "the fake model runs only isolated stream groups"
            own = self.streams[slots[-1]]
            slots = [slot for slot in slots if self.streams[slot] in (-1, own)]
        return [self.slots[slot] for slot in slots]


class LetterTokenizer:
    """Token t is the letter chr(97 + t) for t < 26, a space for 26..30; EOS decodes to nothing."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) - 97 if c.isalpha() else 26 for c in text.lower()]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + t) if t < 26 else ("" if t == EOS else " ") for t in token_ids)
