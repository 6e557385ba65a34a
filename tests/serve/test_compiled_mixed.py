"""The compiled mixed step (serve/worker/compiled_mixed.py `CompiledMixed`, issue 34 item 2): prefill
chunks alone, chunked prefill continuing, prefill chunks beside decode rows and a stream group's
timestep, all through one compiled graph, compute the eager step's logits and write the same K/V, on
one rank and in full TP over two; no recompile as the token count changes."""

from __future__ import annotations

import pytest
import torch

from shiftlm.model.stream_mask import ISOLATED
from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan
from shiftlm.tools.tiny import make_tiny_checkpoint

BLOCK = 4


def mixed_steps(mode: Mode) -> list[StepPlan]:
    """Two prompts prefilled (7 and 5 tokens), the first decoding beside a third prompt's first chunk,
    that chunk's rest beside both decodes, an isolated stream group of 2 streams, then a pure decode."""

    def chunk(seq, tokens, start, blocks=(), sample=True, **extra):
        return ScheduledChunk(seq, tuple(tokens), start, tuple(blocks), sample, row=seq, **extra)

    return [
        StepPlan(
            0,
            mode,
            (
                chunk(0, [5, 17, 33, 2, 9, 100, 7], 0, range(0, 4)),
                chunk(1, [44, 3, 8, 19, 201], 0, range(4, 8)),
            ),
        ),
        StepPlan(1, mode, (chunk(0, [11], 7), chunk(2, [60, 61, 62], 0, range(8, 12), sample=False))),
        StepPlan(2, mode, (chunk(0, [12], 8), chunk(1, [13], 5), chunk(2, [63, 64, 65, 66, 67, 68], 3))),
        StepPlan(
            3,
            mode,
            (
                chunk(
                    3,
                    [7, 7, 7, 9, 9],
                    0,
                    range(12, 14),
                    layout=ISOLATED,
                    prompt_len=3,
                    streams=(-1, -1, -1, 0, 1),
                    positions=(0, 1, 2, 3, 3),
                    sample_rows=2,
                ),
            ),
        ),  # fmt: skip
        StepPlan(4, mode, (chunk(0, [14], 9), chunk(1, [15], 6), chunk(2, [16], 9))),
    ]


def _worst(eager, compiled, plans, run) -> float:
    worst = 0.0
    for plan in plans:
        want, got = run(eager, plan), run(compiled, plan)
        if want is not None:
            worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    return worst


@pytest.mark.parametrize("family", ["llama-gqa", "mistral", "qwen2"])
def test_compiled_mixed_steps_equal_the_eager_step(tmp_path, family):
    from torch._dynamo.utils import counters

    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    model_dir = make_tiny_checkpoint(tmp_path / family, family)
    mesh = Mesh(ParallelConfig())
    eager = ModelRunner.load(model_dir, mesh, num_blocks=32, block_size=BLOCK)
    compiled = ModelRunner.load(model_dir, mesh, num_blocks=32, block_size=BLOCK, compile_mixed=True)
    assert eager.shift_model.compiled_mixed is None and compiled.shift_model.compiled_mixed is not None
    graphs = counters["stats"]["unique_graphs"]
    plans = mixed_steps(Mode.TP)
    assert _worst(eager, compiled, plans, lambda runner, plan: runner.execute(plan)) <= 1e-5
    # every step, the pure decode too: this runner compiles no decode step of its own
    assert compiled.shift_model.compiled_mixed.steps == 5
    assert counters["stats"]["unique_graphs"] == graphs  # 5, 4, 10 and 5 tokens: the warm-up's graph
    written = eager.cache.storage != 0
    assert written.any() and torch.allclose(compiled.cache.storage, eager.cache.storage, rtol=1e-5, atol=1e-6)


def mixed_vs_eager_on_ranks(model_dir: str, tp: int, sp: int) -> dict:
    from torch._dynamo.utils import counters

    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    mesh = Mesh(ParallelConfig(tp=tp, sp=sp))
    eager = ModelRunner.load(model_dir, mesh, num_blocks=32, block_size=BLOCK)
    compiled = ModelRunner.load(model_dir, mesh, num_blocks=32, block_size=BLOCK, compile_mixed=True)
    graphs, worst = counters["stats"]["unique_graphs"], 0.0
    # SP x TP's steps (padded to a multiple of sp: 5 tokens -> 6) through graphs of their own
    for mode in Mode:
        worst = max(worst, _worst(eager, compiled, mixed_steps(mode), lambda r, plan: r.run_step(plan)))
    same_cache = torch.allclose(compiled.cache.storage, eager.cache.storage, rtol=1e-5, atol=1e-6)
    compiles = counters["stats"]["unique_graphs"] - graphs
    steps = compiled.shift_model.compiled_mixed.steps
    return dict(worst=worst, steps=steps, same_cache=same_cache, compiles=compiles)


@pytest.mark.parametrize("tp, sp", [(2, 1), (1, 2)])
def test_compiled_mixed_steps_of_both_modes_on_two_ranks_equal_the_eager_step(ranks, tmp_path, tp, sp):
    """Full TP and SP x TP (Ulysses all-to-alls in the graph, each sp rank its slice of the padded
    batch) on 2 gloo ranks: prefill, chunked prefill beside decodes, a stream group, a decode."""
    model_dir = make_tiny_checkpoint(tmp_path / "m", "llama-gqa")
    results = ranks.run(tp * sp, mixed_vs_eager_on_ranks, str(model_dir), tp, sp)
    assert results[0]["worst"] <= 1e-5, results[0]
    assert [r["steps"] for r in results] == [10, 10]  # every step of both modes, on both ranks
    assert [r["compiles"] for r in results] == [0, 0]  # 3-12 tokens: the warm-up's graphs
    assert all(r["same_cache"] for r in results)


def test_a_step_that_cannot_be_compiled_runs_eagerly_after_one_warning(tmp_path, monkeypatch, caplog):
    """An untried platform where tracing fails (not only inductor): the server still starts and serves."""
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker import compiled_mixed
    from shiftlm.serve.worker.runner import ModelRunner

    def untraceable(*args):
        raise torch._dynamo.exc.Unsupported("planted: an op dynamo cannot trace here")

    monkeypatch.setattr(compiled_mixed, "mixed_step", untraceable)
    model_dir = make_tiny_checkpoint(tmp_path / "m", "llama-gqa")
    with caplog.at_level("WARNING"):
        runner = ModelRunner.load(model_dir, Mesh(ParallelConfig()), 32, BLOCK, compile_mixed=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert runner.shift_model.compiled_mixed is None
    assert len(warnings) == 1 and "mixed step could not be built (Unsupported" in warnings[0]
    assert runner.execute(mixed_steps(Mode.TP)[0]).shape[0] == 2
