"""The compiled decode step (serve/worker/compiled_step.py) computes the eager step's logits and writes the
same K/V: tiny models on one rank, a prefill then decode steps of one and of two sequences whose
contexts cross block boundaries (GQA with rope scaling; a sliding window; q/k/v biases); and the
engine's greedy tokens on the compiled runner, one request at a time, equal Hugging Face `generate`."""

from __future__ import annotations

import pytest
import torch

from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan
from shiftlm.tools.tiny import make_tiny_checkpoint

BLOCK = 4
PROMPTS = ([5, 17, 33, 2, 9, 100, 7], [44, 3, 8, 19, 201])


def steps(mode: Mode) -> list[StepPlan]:
    """Prefill both prompts, 6 decode steps of both, then 3 of the first alone (a batch of 1)."""
    plans = [
        StepPlan(
            0,
            mode,
            tuple(
                ScheduledChunk(i, tuple(p), 0, tuple(range(8 * i, 8 * i + 4)), True, row=i)
                for i, p in enumerate(PROMPTS)
            ),
        )
    ]
    lengths = [len(p) for p in PROMPTS]
    for step in range(9):
        seqs = (0, 1) if step < 6 else (0,)
        chunks = tuple(ScheduledChunk(i, (11 + step + i,), lengths[i], (), True, row=i) for i in seqs)
        for i in seqs:
            lengths[i] += 1
        plans.append(StepPlan(step + 1, mode, chunks))
    return plans


@pytest.mark.parametrize("family", ["llama-gqa", "mistral", "qwen2"])
def test_compiled_decode_equals_the_eager_step(tmp_path, monkeypatch, family):
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    monkeypatch.delenv("SHIFTLM_COMPILE_DECODE", raising=False)  # the eager runner stays eager
    model_dir = make_tiny_checkpoint(tmp_path / family, family)
    mesh = Mesh(ParallelConfig())
    eager = ModelRunner.load(model_dir, mesh, num_blocks=32, block_size=BLOCK)
    # batches of 1 and 2 compiled (where MKL's GEMV is the faster linear, as `gemv_rows=None` measures)
    compiled = ModelRunner.load(
        model_dir, mesh, num_blocks=32, block_size=BLOCK, compile_decode=True, gemv_rows=2
    )
    assert eager.shift_model.compiled is None and compiled.shift_model.compiled is not None
    for mode in Mode:
        for plan in steps(mode):
            want, got = eager.execute(plan), compiled.execute(plan)
            error = (got - want).abs().max() / want.abs().max()
            assert error <= 1e-5, (mode, plan.step, float(error))
        written = eager.cache.storage != 0
        assert torch.allclose(
            compiled.cache.storage[written], eager.cache.storage[written], rtol=1e-5, atol=1e-6
        )
        assert torch.equal(compiled.cache.storage != 0, written)
    assert compiled.shift_model.compiled.steps == 2 * 9  # every decode step of both modes ran compiled
    if family == "llama-gqa":  # end to end: the engine's greedy tokens, one request at a time, equal HF's
        greedy_one_at_a_time_equals_hf(compiled, model_dir)


def greedy_one_at_a_time_equals_hf(runner, model_dir) -> None:
    from shiftlm.serve.engine.scheduler import ShiftPolicy
    from shiftlm.serve.engine.sequence import SamplingParams
    from tests.serve.test_shift_parity import NEW_TOKENS, PROMPTS, _engine, hf_greedy

    steps = runner.shift_model.compiled.steps
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    got = []
    for index, prompt in enumerate(PROMPTS):
        engine = _engine(runner, ShiftPolicy.named("tp"))
        engine.add_request(f"r{index}", prompt, params)
        tokens = []
        while engine.has_work():
            for out in engine.step():
                tokens.extend(out.token_ids)
        got.append(tokens)
    assert got == hf_greedy(model_dir, PROMPTS, NEW_TOKENS)
    assert runner.shift_model.compiled.steps == steps + len(PROMPTS) * (NEW_TOKENS - 1)


def test_compiled_decode_covers_dense_models_on_cpu_and_cuda(tmp_path):
    """The CPU runs fp32 models compiled (the GEMV choice is measured in fp32), CUDA any dtype; other
    devices (the meta device stands in) keep the eager step."""
    from shiftlm.config import ModelConfig
    from shiftlm.model import build_model
    from shiftlm.serve.worker.compiled_step import CompiledDecode

    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama-gqa")
    model = build_model(ModelConfig.from_hf(model_dir), checkpoint=model_dir).eval()
    assert CompiledDecode.supports(model)
    assert not CompiledDecode.supports(model.to(torch.bfloat16))
    assert not CompiledDecode.supports(model.to("meta"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_graph_for_every_batch_equals_the_eager_step(tmp_path, monkeypatch, dtype):
    """The GPU's way (`dynamic_batch`: one graph for a single sequence, one for every larger batch),
    run on the CPU: decode steps of 1 to 5 sequences equal the eager step (fp32 to 1e-5; bf16 within
    bf16's rounding of the same math), with no compile after the warm-up's two."""
    from torch._dynamo.utils import counters

    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.compiled_step import CompiledDecode
    from shiftlm.serve.worker.runner import ModelRunner

    monkeypatch.delenv("SHIFTLM_COMPILE_DECODE", raising=False)
    model_dir = make_tiny_checkpoint(tmp_path / "m", "llama-gqa")
    mesh, torch_dtype = Mesh(ParallelConfig()), getattr(torch, dtype)
    eager, compiled = (
        ModelRunner.load(model_dir, mesh, num_blocks=64, block_size=BLOCK, dtype=torch_dtype, gemv_rows=0)
        for _ in range(2)
    )
    compiled.shift_model.compiled = CompiledDecode(
        compiled.shift_model.model, compiled.cache, max_seqs=8, dynamic_batch=True
    )
    counters.clear()
    assert compiled.shift_model.compiled.warm_up()
    assert counters["stats"]["unique_graphs"] == 2
    prompts = [[(7 * i + j) % 200 + 3 for j in range(3 + i)] for i in range(5)]
    prefill = StepPlan(
        0,
        Mode.TP,
        tuple(
            ScheduledChunk(i, tuple(p), 0, tuple(range(8 * i, 8 * i + 8)), True, row=i)
            for i, p in enumerate(prompts)
        ),
    )
    plans, lengths = [prefill], [len(p) for p in prompts]
    for step in range(1, 9):  # batches of 5, 4, 3, 2, 1, then 5 again
        seqs = range(max(1, 5 - step + 1)) if step <= 5 else range(5)
        plans.append(
            StepPlan(
                step,
                Mode.TP,
                tuple(ScheduledChunk(i, (20 + step,), lengths[i], (), True, row=i) for i in seqs),
            )
        )
        for i in seqs:
            lengths[i] += 1
    tolerance = 1e-5 if dtype == "float32" else 3e-2
    for plan in plans:
        want, got = eager.execute(plan), compiled.execute(plan)
        error = float((got.float() - want.float()).abs().max() / want.float().abs().max())
        assert error <= tolerance, (plan.step, len(plan.chunks), error)
    assert compiled.shift_model.compiled.steps == len(plans) - 1
    assert counters["stats"]["unique_graphs"] == 2  # batch sizes 1-5, contexts 4-13: no recompile


def compiled_vs_eager_on_ranks(model_dir: str, tp: int, sp: int) -> dict:
    """Every rank: an eager and a compiled runner over the same plans (SPMD: every rank runs each
    plan); rank 0 returns the largest relative logit error, every rank its compiled step count."""
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.compiled_step import CompiledDecode
    from shiftlm.serve.worker.runner import ModelRunner

    mesh = Mesh(ParallelConfig(tp=tp, sp=sp))
    eager = ModelRunner.load(model_dir, mesh, num_blocks=32, block_size=BLOCK, gemv_rows=2)
    compiled = ModelRunner.load(
        model_dir, mesh, num_blocks=32, block_size=BLOCK, compile_decode=True, gemv_rows=2
    )
    shift = compiled.shift_model  # SP x TP decodes compiled too, as on CUDA (the CPU leaves them eager)
    assert shift.compiled.ulysses is None
    shift.compiled = CompiledDecode(
        shift.model, compiled.cache, 2, False, shift.full_tp, shift.head_view, shift.ulysses
    )
    assert shift.compiled.warm_up()
    worst = 0.0
    for mode in Mode:
        for plan in steps(mode):
            want, got = eager.run_step(plan), compiled.run_step(plan)
            if mesh.rank == 0:
                worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    same_cache = torch.allclose(compiled.cache.storage, eager.cache.storage, rtol=1e-5, atol=1e-6)
    return dict(worst=worst, steps=compiled.shift_model.compiled.steps, same_cache=same_cache)


@pytest.mark.parametrize("tp, sp", [(2, 1), (1, 2)])
def test_compiled_decode_of_both_modes_on_two_ranks_equals_the_eager_step(ranks, tmp_path, tp, sp):
    """Shift Parallelism's full-TP mode over 2 gloo ranks (tp2, and sp2's latency mode): the compiled
    decode step keeps its sums over the group as traced collectives (comm/traced.py); logits equal
    the eager step's (1e-5), both ranks' caches too; so do SP x TP decodes, compiled with their
    Ulysses all-to-alls in the graph, where their batch needs no padding row (sp2: the 2-sequence
    steps; a 1-sequence step, padded to 2, runs eagerly, or through a graph: test_decode_graphs.py)."""
    model_dir = make_tiny_checkpoint(tmp_path / "m", "llama-gqa")
    results = ranks.run(tp * sp, compiled_vs_eager_on_ranks, str(model_dir), tp, sp)
    assert results[0]["worst"] <= 1e-5, results[0]
    sp_tp = 6 if sp == 2 else 9
    assert [r["steps"] for r in results] == [9 + sp_tp] * 2  # on both ranks
    assert all(r["same_cache"] for r in results)
