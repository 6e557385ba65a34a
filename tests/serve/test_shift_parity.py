"""Greedy outputs are the same in full TP, SP x TP and shift, and equal to Hugging Face `generate`."""

from __future__ import annotations

import pytest
import torch

from shiftlm.serve.engine.core import Engine
from shiftlm.serve.engine.scheduler import SchedulerConfig, ShiftPolicy
from shiftlm.serve.engine.sequence import SamplingParams
from shiftlm.serve.plan import Mode
from shiftlm.tools.tiny import make_tiny_checkpoint
from tests.serve.fakes import LetterTokenizer

PROMPTS = [[5, 17, 33, 2, 9, 100, 7], [44, 3, 8, 19, 201, 6, 6, 12, 90, 11, 3], [240, 1, 77]]
NEW_TOKENS = 6
ARRIVAL_STEP = {0: 0, 1: 1, 4: 2}  # step -> prompt index: the last prefill lands amid decodes


def hf_greedy(model_dir, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare fixed-length outputs
    outputs = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


class AlternatingPolicy:
    """Flips the mode every step, so one request is prefilled in SP x TP and decoded in TP and back."""

    def __init__(self) -> None:
        self.steps = 0

    def mode_for(self, scheduled_tokens: int) -> Mode:
        self.steps += 1
        return Mode.SP_TP if self.steps % 2 else Mode.TP


POLICIES = {
    "tp": lambda: ShiftPolicy.named("tp"),
    "sp_tp": lambda: ShiftPolicy.named("sp_tp"),
    "shift": lambda: ShiftPolicy.named("shift", threshold=4),
    "alternating": AlternatingPolicy,
}


def _engine(runner, policy) -> Engine:
    config = SchedulerConfig(
        num_blocks=32, block_size=4, max_tokens_per_step=12, max_model_len=64, policy=policy
    )
    return Engine(runner, config, LetterTokenizer(), eos_token_ids=set(), vocab_size=250)


def run_modes_on_ranks(model_dir: str, tp: int, sp: int) -> dict | None:
    """Every rank: load the runner; rank 0 drives three engines (tp, sp_tp, shift) over one cache."""
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    mesh = Mesh(ParallelConfig(tp=tp, sp=sp))
    runner = ModelRunner.load(model_dir, mesh, num_blocks=32, block_size=4)
    if mesh.rank != 0:
        runner.serve_steps()
        return None
    cache_ptr = runner.cache.storage.untyped_storage().data_ptr()
    model = runner.shift_model.model
    full_tp = model.full_tp()

    def same_storage(view, weight) -> bool:
        return view.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()

    views_share_storage = all(
        same_storage(layer.self_attn.full_tp_views(full_tp).q, layer.self_attn.q_proj.weight)
        and same_storage(layer.mlp.full_tp_views(full_tp)[2], layer.mlp.down_proj.weight)
        for layer in model.model.layers.values()
    )
    results = {}
    for name, policy in POLICIES.items():
        engine = _engine(runner, policy())
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        outputs: dict[str, list[int]] = {}
        modes = []
        for step in range(200):
            if step in ARRIVAL_STEP:
                index = ARRIVAL_STEP[step]
                engine.add_request(f"r{index}", PROMPTS[index], params)
            elif step > max(ARRIVAL_STEP) and not engine.has_work():
                break
            plan_count = engine.scheduler.stats.steps
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.token_ids)
            if engine.scheduler.stats.steps > plan_count:
                modes.append(engine.scheduler._last_mode.value)
            assert runner.cache.storage.untyped_storage().data_ptr() == cache_ptr
        results[name] = {
            "outputs": [outputs[f"r{i}"] for i in range(len(PROMPTS))],
            "modes": modes,
            "switches": engine.scheduler.stats.mode_switches,
        }
    runner.stop_workers()
    results["views_share_storage"] = views_share_storage
    return results


@pytest.fixture(
    scope="module", params=[("llama-gqa", 2, 2), ("qwen2", 1, 2)], ids=["llama-gqa-kv2-p4", "qwen2-sp2"]
)
def mode_runs(request, ranks, tmp_path_factory):
    family, tp, sp = request.param
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp(family), family)
    results = ranks.run(tp * sp, run_modes_on_ranks, str(model_dir), tp, sp)[0]
    return results, hf_greedy(model_dir, PROMPTS, NEW_TOKENS)


def test_greedy_tokens_match_hf_generate_in_tp_sp_tp_and_shift(mode_runs):
    results, expected = mode_runs
    for name in ("tp", "sp_tp", "shift"):
        assert results[name]["outputs"] == expected, name
    assert set(results["tp"]["modes"]) == {Mode.TP.value}
    assert set(results["sp_tp"]["modes"]) == {Mode.SP_TP.value}
    assert results["shift"]["switches"] >= 2  # prefill in SP x TP, decode in TP, and back


def test_kv_cache_and_weights_stay_in_place_when_every_step_shifts_mode(mode_runs):
    results, expected = mode_runs
    alternating = results["alternating"]
    assert alternating["outputs"] == expected
    assert alternating["switches"] == len(alternating["modes"]) - 1
    # run_modes_on_ranks asserted after every step that the cache storage is the same object
    assert results["views_share_storage"]  # full-TP weights are views into the SP x TP shards
