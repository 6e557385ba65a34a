"""Stream groups give the same greedy tokens in full TP, SP x TP and shift (4 gloo ranks, tp=2 x sp=2,
2 KV heads < P = 4), equal to the Hugging Face references, while the cache stays in place."""

from __future__ import annotations

import pytest

from shiftlm.serve.engine.core import Engine
from shiftlm.serve.engine.scheduler import SchedulerConfig, ShiftPolicy
from shiftlm.serve.engine.sequence import SamplingParams
from tests.serve.fakes import LetterTokenizer
from tests.serve.stream_reference import hf_model, make_position_sensitive_checkpoint, reference
from tests.serve.test_shift_parity import AlternatingPolicy

LAYOUTS = ("isolated", "timestep", "hogwild")
CASES = [
    ([5, 17, 33, 2, 9, 100, 7], [[11, 12], [40], [99, 98, 97]], [4, 3, 5]),
    ([240, 1, 77, 8, 8], [[], [3, 4], [6]], [3, 5, 4]),
]
POLICIES = {
    "tp": lambda: ShiftPolicy.named("tp"),
    "sp_tp": lambda: ShiftPolicy.named("sp_tp"),
    "shift": lambda: ShiftPolicy.named("shift", threshold=4),
    "alternating": AlternatingPolicy,
}


def streams_on_ranks(model_dir: str, tp: int, sp: int) -> dict | None:
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    mesh = Mesh(ParallelConfig(tp=tp, sp=sp))
    runner = ModelRunner.load(model_dir, mesh, num_blocks=48, block_size=4)
    if mesh.rank != 0:
        runner.serve_steps()
        return None
    cache_ptr = runner.cache.storage.untyped_storage().data_ptr()
    results = {}
    for name, policy in POLICIES.items():
        for layout in LAYOUTS:
            config = SchedulerConfig(
                num_blocks=48, block_size=4, max_tokens_per_step=12, max_model_len=64, policy=policy()
            )
            engine = Engine(runner, config, LetterTokenizer(), eos_token_ids=set(), vocab_size=250)
            for g, (prompt, prefixes, max_tokens) in enumerate(CASES):
                params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
                engine.add_streams(f"g{g}", prompt, prefixes, params, layout)
                engine.add_request(
                    f"r{g}", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
                )
            outputs: dict = {}
            while engine.has_work():
                for out in engine.step():
                    outputs.setdefault((out.request_id, out.index), []).extend(out.token_ids)
                assert runner.cache.storage.untyped_storage().data_ptr() == cache_ptr
            results[(name, layout)] = {
                "groups": [[outputs[(f"g{g}", k)] for k in range(3)] for g in range(len(CASES))],
                "switches": engine.scheduler.stats.mode_switches,
            }
    runner.stop_workers()
    return results


@pytest.fixture(scope="module")
def runs(ranks, tmp_path_factory):
    model_dir = make_position_sensitive_checkpoint(tmp_path_factory.mktemp("streams-parity"))
    results = ranks.run(4, streams_on_ranks, str(model_dir), 2, 2)[0]
    model = hf_model(model_dir)
    expected = {layout: [reference(model, layout, *case) for case in CASES] for layout in LAYOUTS}
    return results, expected


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_mode_gives_the_hf_reference_tokens(runs, layout):
    results, expected = runs
    for name in POLICIES:
        assert results[(name, layout)]["groups"] == expected[layout], name
    assert results[("shift", layout)]["switches"] >= 1  # prefill in SP x TP, the tail in TP
    assert results[("alternating", layout)]["switches"] >= 4
