"""Mixture-of-experts models behind the serving engine (issue 32 item 3): greedy completions equal
`transformers.generate` in full TP (every expert's width split over all sp x tp ranks), SP x TP
(experts split over tp, tokens over sp) and shift, over one KV cache."""

from __future__ import annotations

import io
import json

import pytest

from shiftlm.config import ModelConfig
from shiftlm.serve.engine.sequence import SamplingParams
from shiftlm.tools.tiny import make_tiny_checkpoint
from tests.serve.test_shift_parity import ARRIVAL_STEP, NEW_TOKENS, POLICIES, PROMPTS, _engine, hf_greedy


def serve_modes_on_ranks(model_dir: str, tp: int, sp: int) -> dict | None:
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    mesh = Mesh(ParallelConfig(tp=tp, sp=sp))
    runner = ModelRunner.load(model_dir, mesh, num_blocks=32, block_size=4)
    if mesh.rank != 0:
        runner.serve_steps()
        return None
    results = {}
    for name in ("tp", "sp_tp", "shift"):
        engine = _engine(runner, POLICIES[name]())
        runner.on_expert_rows = engine.metrics.record_expert_rows
        engine.step_log = io.StringIO()
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        outputs: dict[str, list[int]] = {}
        for step in range(200):
            if step in ARRIVAL_STEP:
                engine.add_request(f"r{ARRIVAL_STEP[step]}", PROMPTS[ARRIVAL_STEP[step]], params)
            elif step > max(ARRIVAL_STEP) and not engine.has_work():
                break
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.token_ids)
        results[name] = {
            "outputs": [outputs[f"r{i}"] for i in range(len(PROMPTS))],
            "steps_per_mode": dict(engine.scheduler.stats.steps_per_mode),
            "expert_rows": engine.metrics.expert_rows,
            "step_tokens": sum(engine.metrics.step_tokens.values()),
            "steps": engine.scheduler.stats.steps,
            "step_log": [json.loads(line) for line in engine.step_log.getvalue().splitlines()],
        }
    runner.stop_workers()
    return results


@pytest.mark.parametrize(
    ("family", "tp", "sp"),
    [("mixtral", 1, 2), ("qwen2-moe", 2, 1), ("qwen3-moe", 2, 2)],
    ids=["mixtral-sp2", "qwen2-moe-tp2", "qwen3-moe-tp2-sp2"],
)
def test_moe_greedy_tokens_match_hf_generate_in_every_mode(ranks, tmp_path, family, tp, sp):
    model_dir = make_tiny_checkpoint(tmp_path / family, family)
    results = ranks.run(tp * sp, serve_modes_on_ranks, str(model_dir), tp, sp)[0]
    expected = hf_greedy(model_dir, PROMPTS, NEW_TOKENS)
    for name in ("tp", "sp_tp", "shift"):
        assert results[name]["outputs"] == expected, name
    assert set(results["shift"]["steps_per_mode"]) == {"tp", "sp_tp"} or sp == 1  # it shifted
    # the load per expert: every token's top-k choices in every MoE layer (plus sp padding rows)
    config = ModelConfig.from_hf(model_dir)
    per_token = config.num_experts_per_tok * config.moe_layers
    for name in ("tp", "sp_tp", "shift"):
        run = results[name]
        routed = sum(run["expert_rows"])
        assert len(run["expert_rows"]) == config.num_experts
        assert (
            run["step_tokens"] * per_token
            <= routed
            <= (run["step_tokens"] + run["steps"] * (sp - 1)) * per_token
        )


def test_the_load_per_expert_reaches_metrics(tmp_path):
    """A step's rows per expert accumulate into /metrics' counter; the last one is the step log's."""
    from shiftlm.serve.engine.metrics import ServingMetrics

    metrics = ServingMetrics()
    metrics.record_expert_rows([3.0, 0.0, 5.0])
    metrics.record_expert_rows([1.0, 2.0, 0.0])
    page = metrics.render({}, {})
    assert 'shiftlm_moe_expert_rows_total{expert="0"} 4' in page
    assert 'shiftlm_moe_expert_rows_total{expert="1"} 2' in page
    assert 'shiftlm_moe_expert_rows_total{expert="2"} 5' in page
    assert metrics.last_expert_rows == [1.0, 2.0, 0.0]
    assert "moe_expert_rows" not in ServingMetrics().render({}, {})  # dense models: no such lines


def test_serving_reads_the_experts_in_place(tmp_path):
    """After load, each MoE layer's experts are views of one stacked tensor per projection, and a step's
    grouped GEMMs take views of it (full TP's narrowed ones too): no stacked copy of every expert per
    step, which made a 16-expert model's decode step 3-8x slower (`SparseMoE.stack_experts`)."""
    import torch

    from shiftlm.mesh import Mesh
    from shiftlm.model.attention import FullTP
    from shiftlm.model.moe import SparseMoE
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    model_dir = make_tiny_checkpoint(tmp_path / "q", "qwen2-moe")
    runner = ModelRunner.load(model_dir, Mesh(ParallelConfig()), num_blocks=16, block_size=4)
    layers = [m for m in runner.shift_model.model.modules() if isinstance(m, SparseMoE)]
    assert layers
    for layer in layers:
        stacked = layer._stacked
        for expert_index, expert in enumerate(layer.experts.values()):
            for projection, name in enumerate(expert.names):
                weight = getattr(expert, name).weight
                assert weight.data_ptr() == stacked[projection][expert_index].data_ptr()
        half = FullTP(runner.mesh.shift, 1, 2)  # a full-TP rank's sub-slice: narrowed views
        for views in (layer.stacked_weights(), layer.stacked_weights(half)):
            for view, whole in zip(views, stacked):
                assert view.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
        assert torch.equal(layer.stacked_weights(half)[2], stacked[2][..., stacked[2].shape[2] // 2 :])
