"""Stream groups in the engine (one rank, in process): every layout's greedy tokens equal an
independent Hugging Face reference (tests/serve/stream_reference.py), next to ordinary requests, with
chunked prefill and under preemption; `isolated` equals K independent requests; the prompt's blocks
are allocated once; bad groups are refused with the reason."""

from __future__ import annotations

import random
import re

import pytest

from shiftlm.serve.engine.core import Engine
from shiftlm.serve.engine.errors import InvalidRequest
from shiftlm.serve.engine.scheduler import SchedulerConfig
from shiftlm.serve.engine.sequence import SamplingParams
from tests.serve.fakes import LetterTokenizer
from tests.serve.stream_reference import hf_model, make_position_sensitive_checkpoint, reference

LAYOUTS = ("isolated", "timestep", "hogwild")
BLOCK = 4


def cases(count: int, seed: int = 0) -> list[tuple[list[int], list[list[int]], list[int]]]:
    """(prompt, per-stream prefixes (some empty), per-stream max_tokens) with 3 streams."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = [rng.randrange(250) for _ in range(rng.randrange(3, 10))]
        prefixes = [[rng.randrange(250) for _ in range(rng.randrange(0, 4))] for _ in range(3)]
        out.append((prompt, prefixes, [rng.randrange(2, 6) for _ in range(3)]))
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_position_sensitive_checkpoint(tmp_path_factory.mktemp("streams"))


@pytest.fixture(scope="module")
def runner(checkpoint):
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    return ModelRunner.load(checkpoint, Mesh(ParallelConfig()), num_blocks=64, block_size=BLOCK)


def engine_for(runner, num_blocks=64, budget=16) -> Engine:
    config = SchedulerConfig(
        num_blocks=num_blocks, block_size=BLOCK, max_tokens_per_step=budget, max_model_len=64
    )
    return Engine(runner, config, LetterTokenizer(), eos_token_ids=set(), vocab_size=250)


class Recorder:
    def __init__(self, runner):
        self.runner, self.plans = runner, []

    def execute(self, plan):
        self.plans.append(plan)
        return self.runner.execute(plan)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def run(engine: Engine) -> dict[tuple[str, int], list[int]]:
    outputs: dict[tuple[str, int], list[int]] = {}
    for _ in range(2000):
        if not engine.has_work():
            return outputs
        for out in engine.step():
            outputs.setdefault((out.request_id, out.index), []).extend(out.token_ids)
    raise AssertionError("the engine did not finish")


def run_groups(engine: Engine, groups, layout: str, with_requests: bool = True, request_tokens: int = 5):
    """Add every group (and an ordinary request per group); the groups' outputs per stream."""
    for g, (prompt, prefixes, max_tokens) in enumerate(groups):
        engine.add_streams(f"g{g}", prompt, prefixes, [greedy(m) for m in max_tokens], layout)
        if with_requests:
            engine.add_request(f"r{g}", prompt[::-1], greedy(request_tokens))
    outputs = run(engine)
    return [[outputs.get((f"g{g}", k), []) for k in range(3)] for g in range(len(groups))]


@pytest.fixture(scope="module")
def expected(checkpoint):
    model = hf_model(checkpoint)
    return {layout: [reference(model, layout, *case) for case in cases(4)] for layout in LAYOUTS}


def test_the_layouts_give_different_tokens_on_this_checkpoint(expected):
    # otherwise the HF comparisons below could not tell a layout from another
    for a, b in (("isolated", "timestep"), ("timestep", "hogwild")):
        assert expected[a] != expected[b]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_streams_equal_the_hf_reference_next_to_ordinary_requests(runner, expected, layout):
    assert run_groups(engine_for(runner), cases(4), layout) == expected[layout]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_blocks, budget", [(64, 4), (16, 16)], ids=["chunked", "preempted"])
def test_chunked_prefill_and_preemption_keep_every_stream_exact(runner, expected, layout, num_blocks, budget):
    engine = engine_for(runner, num_blocks=num_blocks, budget=budget)
    engine.runner = recorder = Recorder(runner)
    request_tokens = 40 if num_blocks == 16 else 5  # long ordinary requests fill the small cache
    assert run_groups(engine, cases(4), layout, request_tokens=request_tokens) == expected[layout]
    group_chunks = [c for plan in recorder.plans for c in plan.chunks if c.layout]
    if num_blocks == 16:  # some group was preempted (whole) and recomputed: its chunks went back
        last: dict[int, int] = {}
        went_back = set()
        for c in group_chunks:
            if c.start < last.get(c.seq_id, -1):
                went_back.add(c.seq_id)
            last[c.seq_id] = c.start
        assert went_back
    else:  # some group's prompt went in several chunks, and no chunk split a timestep
        assert any(not c.sample and c.start > 0 for c in group_chunks)
    assert engine.scheduler.blocks.allocator.num_free == num_blocks  # nothing leaked


def test_isolated_streams_equal_independent_requests_token_for_token(runner):
    engine = engine_for(runner)
    prompt, prefixes, max_tokens = cases(1, seed=3)[0]
    alone = engine_for(runner)
    for k, (prefix, m) in enumerate(zip(prefixes, max_tokens)):
        alone.add_request(f"s{k}", prompt + prefix, greedy(m))
    independent = run(alone)
    got = run_groups(engine, [(prompt, prefixes, max_tokens)], "isolated", with_requests=False)[0]
    assert got == [independent[(f"s{k}", 0)] for k in range(3)]


def held_blocks(engine: Engine) -> int:
    allocator = engine.scheduler.blocks.allocator
    return allocator.num_blocks - allocator.num_free


def test_the_shared_prompt_is_allocated_once(runner):
    prompt = list(range(1, 17))  # 4 full blocks
    engine = engine_for(runner, budget=64)
    engine.add_streams("g", prompt, [[], [], [], []], [greedy(4)] * 4, "timestep")
    engine.step()  # the prompt; its last row gives each of the 4 streams its first token
    assert held_blocks(engine) == 4
    engine.step()  # the 4 streams' first tokens: 20 slots, 5 blocks, the prompt's 4 among them once
    group = engine.scheduler.running[0]
    assert held_blocks(engine) == 5 and len(set(group.block_ids)) == 5
    independent = engine_for(runner, budget=64)
    independent.scheduler.blocks.enable_prefix_caching = False
    for k in range(4):
        independent.add_request(f"s{k}", prompt, greedy(4))
    independent.step()
    assert held_blocks(independent) == 4 * 4  # each request holds its own copy of the prompt's blocks


@pytest.mark.parametrize(
    "prefixes, params, layout, message",
    [
        ([], [], "timestep", "streams is empty"),
        ([[1]] * 17, [greedy(1)] * 17, "timestep", "too many streams"),
        ([[1]] * 16, [greedy(16)] * 16, "timestep", "too many streams for the cache"),
        ([[1]], [greedy(61)], "timestep", "streams[0]: prompt + prefix + max_tokens = 65"),
        ([[1], [2]], [greedy(2)], "timestep", "2 streams but 1"),
        ([[1], [2]], [greedy(2), SamplingParams(max_tokens=0)], "timestep", "streams[1]: max_tokens"),
        ([[1]], [greedy(2)], "braided", "unknown layout 'braided'"),
    ],
)
def test_a_bad_group_is_refused_with_the_reason_and_others_run(runner, prefixes, params, layout, message):
    engine = engine_for(runner)
    engine.add_request("ok", [5, 6, 7], greedy(3))
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        engine.add_streams("bad", [1, 2, 3], prefixes, params, layout)
    assert len(run(engine)[("ok", 0)]) == 3
    assert engine.scheduler.blocks.allocator.num_free == 64
