"""A mixture of experts through the compiled steps (serve/worker/compiled_step.py, compiled_mixed.py):
in bf16, where the grouped expert GEMMs trace (`torch._grouped_mm`) and routing has no data-dependent
size, tiny Mixtral, Qwen2-MoE (shared expert) and Qwen3-MoE run their decode steps compiled, with the
eager step's logits (bf16: 3e-2) and this step's rows per expert for /metrics and the step log."""

from __future__ import annotations

import pytest
import torch

from shiftlm.serve.plan import Mode
from shiftlm.tools.tiny import make_tiny_checkpoint
from tests.serve.test_compiled_decode import BLOCK, steps


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe", "qwen3-moe"])
def test_compiled_moe_steps_equal_the_eager_step(tmp_path, family):
    from torch._dynamo.utils import counters

    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    model_dir = make_tiny_checkpoint(tmp_path / family, family)
    mesh, options = Mesh(ParallelConfig()), dict(num_blocks=32, block_size=BLOCK, dtype=torch.bfloat16)
    eager = ModelRunner.load(model_dir, mesh, **options)
    compiled = ModelRunner.load(
        model_dir, mesh, compile_decode=True, gemv_rows=2, compile_mixed=True, **options
    )
    model = compiled.shift_model
    assert model.compiled is not None and model.compiled_mixed is None and model.graphs is None
    graphs = counters["stats"]["unique_graphs"]
    for plan in steps(Mode.TP):  # a prefill of two prompts (eager), decodes of 2 then 1 sequence
        want, got = eager.execute(plan), compiled.execute(plan)
        error = float((got.float() - want.float()).abs().max() / want.float().abs().max())
        assert error <= 3e-2, (plan.step, error)
        # this step's counts (not a stale step's: every token's top-k choices in every layer), routed
        # as the eager step routes but for bf16 near-ties, which the two roundings may split otherwise
        rows, eager_rows = model.expert_rows, eager.shift_model.expert_rows
        assert float((rows - eager_rows).abs().sum()) <= 0.25 * float(rows.sum()), (
            plan.step,
            rows,
            eager_rows,
        )
        tokens = sum(len(chunk.token_ids) for chunk in plan.chunks)
        assert int(rows.sum()) == tokens * model.config.num_experts_per_tok * len(model.moe_layers)
    assert model.compiled.steps == 9  # every decode step (the prefill runs eagerly)
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled after the warm-ups
