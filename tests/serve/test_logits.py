"""Which rank sends which block of the sampled logits back to rank 0 (shiftlm/serve/worker/logits.py)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftlm.mesh import Coords
from shiftlm.serve.plan import Mode
from shiftlm.serve.worker.logits import logits_block
from shiftlm.serve.worker.paged_attention import FlatBatch


def _batch(num_tokens: int, sp: int, sampled: list[int]) -> FlatBatch:
    padded = num_tokens + (-num_tokens % sp)
    rows = torch.arange(padded)
    sample_rows = torch.tensor(sorted({row % num_tokens for row in sampled}), dtype=torch.long)
    return FlatBatch(rows, rows, rows, (), sample_rows, num_tokens)


@settings(max_examples=60, deadline=None)
@given(
    sp=st.integers(1, 4),
    tp=st.integers(1, 3),
    vocab_per_tp=st.integers(1, 40),
    num_tokens=st.integers(1, 30),
    sampled=st.lists(st.integers(0, 1000), min_size=1, max_size=12),
    mode=st.sampled_from(list(Mode)),
)
def test_the_ranks_blocks_tile_the_sampled_logits_exactly_once(
    sp, tp, vocab_per_tp, num_tokens, sampled, mode
):
    batch = _batch(num_tokens, sp, sampled)
    per_rank = batch.token_ids.numel() // sp
    owners = torch.zeros(batch.sample_rows.numel(), vocab_per_tp * tp, dtype=torch.long)
    for rank_sp in range(sp):
        for rank_tp in range(tp):
            coords = Coords(0, 0, rank_sp, rank_tp)
            block = logits_block(batch.sample_rows, batch.token_ids.numel(), mode, coords, sp, vocab_per_tp)
            owners[block.sample_index, block.vocab_start : block.vocab_start + block.vocab_len] += 1
            # the rows the rank reads from its own hidden states are the sampled rows it owns
            first_row = rank_sp * per_rank if mode is Mode.SP_TP else 0
            assert torch.equal(block.hidden_rows + first_row, batch.sample_rows[block.sample_index])
    assert bool((owners == 1).all())
