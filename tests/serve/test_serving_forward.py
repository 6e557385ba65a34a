"""The serving forward (the model's own layers over the paged backend, in full TP and in SP x TP, on
P ranks) computes the same logits as the core model's dense forward on one rank."""

from __future__ import annotations

import pytest
import torch

from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan
from shiftlm.tools.tiny import make_tiny_checkpoint

SEQ_A = [5, 17, 33, 2, 9, 100, 7, 44]
SEQ_B = [44, 3, 8, 19, 201, 6, 6, 12, 90]
BLOCK = 4


def plans(mode: Mode, row: int, block: int) -> list[tuple[StepPlan, list[tuple[str, int]]]]:
    """A prefill, a step mixing a decode with a prefill chunk, then a chunk that continues a prefix
    (context from earlier steps) and grows its block table; each with the (sequence, position) of its
    logits rows. Every chunk but the decode asks for all rows (all_logits)."""
    a, b = row, row + 1
    first = ScheduledChunk(0, tuple(SEQ_A[:7]), 0, (block, block + 1), False, True, 0, a)
    decode = ScheduledChunk(0, tuple(SEQ_A[7:]), 7, (), True, False, 2, a)
    b_head = ScheduledChunk(1, tuple(SEQ_B[:5]), 0, (block + 2, block + 3), False, True, 0, b)
    b_tail = ScheduledChunk(1, tuple(SEQ_B[5:]), 5, (block + 4,), True, True, 2, b)
    return [
        (StepPlan(0, mode, (first,)), [("a", p) for p in range(7)]),
        (StepPlan(1, mode, (decode, b_head)), [("a", 7)] + [("b", p) for p in range(5)]),
        (StepPlan(2, mode, (b_tail,)), [("b", p) for p in range(5, 9)]),
    ]


def serving_logits_on_ranks(model_dir: str, tp: int, sp: int) -> dict | None:
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    mesh = Mesh(ParallelConfig(tp=tp, sp=sp))
    runner = ModelRunner.load(model_dir, mesh, num_blocks=16, block_size=BLOCK)
    results = {}
    for index, mode in enumerate(Mode):
        rows = []
        for plan, names in plans(mode, row=2 * index, block=8 * index):
            logits = runner.run_step(plan)
            if logits is not None:
                rows += [(name, logits[i, : runner.model_config.vocab_size]) for i, name in enumerate(names)]
        results[mode.value] = rows
    return results if mesh.rank == 0 else None


@pytest.mark.parametrize(
    ("family", "tp", "sp"),
    [("llama-gqa", 2, 2), ("mistral", 1, 2)],
    ids=["llama-gqa-p4", "mistral-window-sp2"],
)
def test_serving_forward_in_both_modes_equals_the_core_forward(ranks, tmp_path, family, tp, sp):
    from shiftlm.config import ModelConfig
    from shiftlm.model import build_model

    model_dir = make_tiny_checkpoint(tmp_path / family, family)
    core = build_model(ModelConfig.from_hf(model_dir), checkpoint=model_dir).eval()
    with torch.no_grad():
        expected = {name: core(torch.tensor([seq]))[0] for name, seq in (("a", SEQ_A), ("b", SEQ_B))}
    results = ranks.run(tp * sp, serving_logits_on_ranks, str(model_dir), tp, sp)[0]
    for mode in Mode:
        rows = results[mode.value]
        assert len(rows) == 7 + 6 + 4
        for (name, position), got in rows:
            reference = expected[name][position, : got.numel()]
            error = (got - reference).abs().max() / reference.abs().max()
            assert error <= 1e-5, (mode, name, position, float(error))
