from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftlm.serve.engine.core import Engine
from shiftlm.serve.engine.errors import InvalidRequest, PromptTooLong
from shiftlm.serve.engine.scheduler import SchedulerConfig, ShiftPolicy
from shiftlm.serve.engine.sequence import SamplingParams
from tests.serve.fakes import EOS, VOCAB, LetterTokenizer, SlotRunner, reference_greedy


def _engine(
    num_blocks=64, block_size=4, budget=32, max_model_len=64, async_scheduling=False, **config
) -> Engine:
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_tokens_per_step=budget,
        max_model_len=max_model_len,
        policy=ShiftPolicy(8),
        **config,
    )
    return Engine(
        SlotRunner(num_blocks, block_size),
        config,
        LetterTokenizer(),
        eos_token_ids={EOS},
        vocab_size=VOCAB,
        async_scheduling=async_scheduling,
    )


def _run(engine: Engine, max_steps: int = 2000) -> dict[tuple[str, int], list]:
    results: dict[tuple[str, int], list] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return results
        for out in engine.step():
            results.setdefault((out.request_id, out.index), []).append(out)
    raise AssertionError("the engine did not finish within the step bound")


def _tokens(outputs) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=20), min_size=1, max_size=8),
    max_tokens=st.integers(1, 12),
    num_blocks=st.integers(8, 24),
    budget=st.integers(1, 24),
    prefix_caching=st.booleans(),
    async_scheduling=st.booleans(),
)
def test_every_request_gets_its_exact_greedy_output_under_any_cache_pressure(
    prompts, max_tokens, num_blocks, budget, prefix_caching, async_scheduling
):
    """With `async_scheduling` steps run ahead of their tokens (tests/serve/test_async_scheduling.py)."""
    engine = _engine(num_blocks, 4, budget, 32, async_scheduling, enable_prefix_caching=prefix_caching)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    results = _run(engine)
    for i, prompt in enumerate(prompts):
        expected = reference_greedy(prompt, min(max_tokens, 32 - len(prompt)))
        assert _tokens(results[(f"r{i}", 0)]) == expected
    assert engine.scheduler.blocks.allocator.num_free == num_blocks  # nothing leaked
    assert all(seq.num_pending == 0 for seq in engine.scheduler.running)
    if async_scheduling and max_tokens > 2 and budget >= 20:  # room for every decode: steps ran ahead
        assert engine.runner.ahead > 0


def test_a_small_cache_forces_preemption_and_still_every_output_is_exact():
    engine = _engine(num_blocks=10, block_size=4, budget=16, max_model_len=40)
    prompts = [[i, i + 1, i + 2, 3, 4, 5, 6] for i in range(6)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    results = _run(engine)
    assert engine.scheduler.stats.preemptions > 0
    for i, prompt in enumerate(prompts):
        assert _tokens(results[(f"r{i}", 0)]) == reference_greedy(prompt, 20)


def test_n_samples_run_as_an_isolated_group_holding_the_prompt_once():
    engine = _engine()
    prompt = list(range(10))  # two full blocks of 4 and a tail of 2
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=3, ignore_eos=True)
    engine.add_request("r", prompt, params)
    outputs = engine.step()  # the prompt; its last row gives each sample its first token
    assert sorted(out.index for out in outputs) == [0, 1, 2]
    outputs += engine.step()  # the 3 first tokens go after the prompt in the group's one table: 13 slots
    allocator = engine.scheduler.blocks.allocator
    assert allocator.num_blocks - allocator.num_free == 4  # not 3 copies of the prompt's blocks
    results = {key: _tokens(value) for key, value in _run(engine).items()}
    samples = [_tokens([o for o in outputs if o.index == i]) + results[("r", i)] for i in range(3)]
    assert all(len(sample) == 6 for sample in samples)
    assert len({tuple(sample) for sample in samples}) > 1
    # each sample saw the prompt and its own tokens only: it is the seeded request of seed 7 + i
    for i in range(3):
        alone = _engine()
        alone.add_request(
            "a", prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=7 + i, ignore_eos=True)
        )
        assert _tokens(_run(alone)[("a", 0)]) == samples[i]


def test_n_samples_that_cannot_fit_the_cache_together_are_refused_not_recomputed_forever():
    """The n samples are one group in the cache: one bigger than the whole cache preempted itself
    and was recomputed from scratch every step (a server found spinning 11,000 steps on one request
    of n=4, 200 tokens each, over a 512-slot cache). It is a 400 naming n now, and a request
    without max_tokens gets each sample's share of the cache by default."""
    engine = _engine(num_blocks=16, block_size=4, max_model_len=40)  # 64 slots
    prompt = list(range(10))
    with pytest.raises(
        InvalidRequest, match="too many samples for the cache: the group needs 130 KV slots"
    ) as err:
        engine.add_request("r", prompt, SamplingParams(max_tokens=30, n=4, ignore_eos=True))
    assert err.value.param == "n" and not engine.has_work()
    share = engine.max_tokens_left(len(prompt), n=4)
    assert share == (64 - 10) // 4 and engine.max_tokens_left(len(prompt)) == 30  # n=1: the context
    engine.add_request("r", prompt, SamplingParams(max_tokens=share, n=4, ignore_eos=True))
    results = _run(engine)
    assert [len(_tokens(results[("r", i)])) for i in range(4)] == [share] * 4


def test_a_seed_makes_sampling_reproducible():
    def sample_once():
        engine = _engine()
        engine.add_request(
            "r", [1, 2, 3], SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
        )
        return _tokens(_run(engine)[("r", 0)])

    assert sample_once() == sample_once()


def test_a_stop_string_ends_the_sample_and_is_cut_from_the_text():
    engine = _engine()
    expected = LetterTokenizer().decode(reference_greedy([5, 6], 12))
    stop = expected[4:6]
    engine.add_request(
        "r", [5, 6], SamplingParams(max_tokens=12, temperature=0, stop=(stop,), ignore_eos=True)
    )
    outputs = _run(engine)[("r", 0)]
    assert "".join(out.text for out in outputs) == expected[: expected.find(stop)]
    assert outputs[-1].finish_reason == "stop" and outputs[-1].stop_reason == stop  # vLLM's stop_reason
    engine.add_request(  # vLLM's include_stop_str_in_output: the text ends with the stop string
        "i",
        [5, 6],
        SamplingParams(
            max_tokens=12, temperature=0, stop=(stop,), ignore_eos=True, include_stop_str_in_output=True
        ),
    )
    included = "".join(out.text for out in _run(engine)[("i", 0)])
    assert included == expected[: expected.find(stop) + len(stop)]


def test_eos_finishes_a_sample_unless_ignore_eos():
    prompt = next(p for p in ([a, b] for a in range(30) for b in range(30)) if EOS in reference_greedy(p, 10))
    stops = reference_greedy(prompt, 10).index(EOS) + 1
    for ignore_eos, length in ((False, stops), (True, 10)):
        engine = _engine()
        engine.add_request("r", prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=ignore_eos))
        outputs = _run(engine)[("r", 0)]
        assert len(_tokens(outputs)) == length and outputs[-1].stop_reason is None  # EOS: none, as vLLM


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_stop_token_id_ends_the_sample_in_its_ids_not_its_text(async_scheduling):
    """vLLM's `stop_token_ids`: the first one drawn finishes the sample with "stop" (ignore_eos or
    not); the token is the last of the sample's ids and adds nothing to its text."""
    expected = reference_greedy([5, 6], 12)
    stop_at = next(i for i in range(2, 12) if expected[i] not in expected[:i] and expected[i] != EOS)
    engine = _engine(async_scheduling=async_scheduling)
    params = SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(expected[stop_at],)
    )
    engine.add_request("r", [5, 6], params)
    outputs = _run(engine)[("r", 0)]
    assert _tokens(outputs) == expected[: stop_at + 1]
    assert "".join(out.text for out in outputs) == LetterTokenizer().decode(expected[:stop_at])
    engine.add_request("i", [5, 6], replace(params, include_stop_str_in_output=True))
    included = _run(engine)[("i", 0)]  # the stop token's text kept
    assert "".join(out.text for out in included) == LetterTokenizer().decode(expected[: stop_at + 1])
    assert outputs[-1].finish_reason == "stop" and outputs[-1].stop_reason == expected[stop_at]
    assert not engine.has_work()


def test_stop_token_ids_outside_the_vocabulary_are_refused():
    engine = _engine()
    with pytest.raises(InvalidRequest, match=rf"stop_token_ids must be in \[0, {VOCAB}\)"):
        engine.add_request("r", [1], SamplingParams(stop_token_ids=(3, VOCAB)))
    assert not engine.has_work()


def test_a_prompt_that_fills_the_context_is_rejected_and_nothing_is_queued():
    engine = _engine(max_model_len=16)
    with pytest.raises(PromptTooLong):
        engine.add_request("r", list(range(16)), SamplingParams())
    with pytest.raises(InvalidRequest, match="temperature"):
        engine.add_request("r", [1], SamplingParams(temperature=-1))
    assert not engine.has_work()


def test_aborting_a_request_frees_its_blocks():
    engine = _engine(num_blocks=16)
    engine.add_request("r", list(range(9)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    engine.step()
    engine.abort("r")
    assert not engine.has_work() and engine.scheduler.blocks.allocator.num_free == 16


def test_a_planted_hash_collision_never_answers_one_prompt_with_anothers_kv(monkeypatch):
    """Issue 35.3 through the engine: every block hashes alike (a planted collision); the second
    prompt finds the first one's block by hash, the tokens differ, so nothing is shared and its
    greedy output is its own (SlotRunner reads the context back from the cache slots)."""
    from shiftlm.serve.engine import kv_blocks

    monkeypatch.setattr(kv_blocks, "block_hash", lambda parent, tokens: b"collide")
    engine = _engine()
    first, second = [1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6, 5, 4, 3, 2, 1]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.add_request("a", first, params)
    assert _tokens(_run(engine)[("a", 0)]) == reference_greedy(first, 6)
    engine.add_request("b", second, params)
    assert _tokens(_run(engine)[("b", 0)]) == reference_greedy(second, 6)
    assert engine.scheduler.blocks.prefix_hits == 0
    engine.add_request("c", first, params)  # the same tokens still hit
    assert _tokens(_run(engine)[("c", 0)]) == reference_greedy(first, 6)
    assert engine.scheduler.blocks.prefix_hits > 0
