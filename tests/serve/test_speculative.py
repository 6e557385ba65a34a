"""Speculative decoding by n-gram lookup (`--speculative-config`, engine/speculative.py): drafts are
verified in one step and kept as far as the draws agree, so every request's output equals the engine's
without speculation, token for token (greedy, seeded sampling, penalties, logprobs, stop strings,
EOS, max_tokens and the context's end, chunked prefill, preemption, the prefix cache), while drafts
are kept and rejected."""

from __future__ import annotations

import functools
import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftlm.errors import ConfigError
from shiftlm.serve.engine.core import Engine
from shiftlm.serve.engine.scheduler import SchedulerConfig, ShiftPolicy
from shiftlm.serve.engine.sequence import SamplingParams, Sequence
from shiftlm.serve.engine.speculative import NgramProposer, SpeculativeConfig
from tests.serve.fakes import EOS, VOCAB, LetterTokenizer, SlotRunner, next_token_scores

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
SUFFIX = SpeculativeConfig.parse(
    {"method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_max_tree_depth": 8}
)


def copy_scores(context: list[int], pull: float = 9.0):
    """The fakes' stand-in model with a pull towards copying: the token that followed the latest
    earlier occurrence of the last token gets +`pull` (an induction head); at 9 drafts are often,
    not always, what it draws."""
    scores = next_token_scores(context)
    for i in range(len(context) - 2, -1, -1):
        if context[i] == context[-1]:
            scores[context[i + 1]] += pull
            break
    return scores


def _engine(speculative, num_blocks=64, budget=32, max_model_len=64) -> Engine:
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=4,
        max_tokens_per_step=budget,
        max_model_len=max_model_len,
        policy=ShiftPolicy(8),
        speculative=speculative,
    )
    runner = SlotRunner(num_blocks, 4, copy_scores)
    return Engine(runner, config, LetterTokenizer(), eos_token_ids={EOS}, vocab_size=VOCAB)


def _run(engine: Engine) -> dict:
    results: dict = {}
    for _ in range(3000):
        if not engine.has_work():
            return {
                key: (
                    [t for out in outs for t in out.token_ids],
                    "".join(out.text for out in outs),
                    outs[-1].finish_reason,
                    outs[-1].stop_reason,
                    [out.logprobs for out in outs],
                    outs[0].prompt_logprobs,
                )
                for key, outs in results.items()
            }
        for out in engine.step():
            results.setdefault((out.request_id, out.index), []).append(out)
    raise AssertionError("the engine did not finish within the step bound")


def _requests(engine: Engine) -> None:
    """Every kind of request, on repetitive prompts (what n-gram drafts find)."""
    prompts = [
        [1, 2, 3, 4, 1, 2, 3, 4, 1, 2],
        [5, 6, 7, 5, 6, 7, 5],
        [8, 9, 8, 9, 8, 9, 8, 9, 8],
        [10, 11, 12, 13, 10, 11, 12],
        [3, 3, 3, 3, 3, 3],
        [20, 21, 20, 21, 20],
    ]
    kinds = [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=19, temperature=1.0, seed=3, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=15, temperature=0.8, seed=1, frequency_penalty=0.5, min_tokens=4),
        SamplingParams(max_tokens=18, temperature=0.9, top_k=8, top_p=0.9, seed=7, repetition_penalty=1.3),
        SamplingParams(max_tokens=30, temperature=0, stop=("dab",), ignore_eos=True),  # a stop string
        SamplingParams(max_tokens=16, temperature=1.5, seed=11),  # EOS may end it
        SamplingParams(max_tokens=9, temperature=0, n=2, ignore_eos=True),  # a group: never drafts
        SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=60, temperature=0, ignore_eos=True),  # to the context's end
        SamplingParams(max_tokens=14, temperature=0.7, seed=5, stop_token_ids=(2,), ignore_eos=True),
        # penalties strong enough that a row must count the drafts before it as its outputs
        SamplingParams(max_tokens=20, temperature=0, frequency_penalty=2.0, presence_penalty=2.0),
        SamplingParams(max_tokens=20, temperature=0, repetition_penalty=3.0, ignore_eos=True),
    ]
    for i, params in enumerate(kinds):
        prompt = prompts[i % len(prompts)]
        if params.max_tokens == 60:
            params = SamplingParams(max_tokens=64 - len(prompt), temperature=0, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params)


@pytest.mark.parametrize("method", [SPEC, SUFFIX], ids=["ngram", "suffix"])
@pytest.mark.parametrize(
    "budget,num_blocks", [(32, 64), (5, 64), (32, 16)], ids=["roomy", "chunked", "preempting"]
)
def test_every_kind_of_request_gets_what_the_engine_without_drafts_gives(budget, num_blocks, method):
    outputs = []
    for speculative in (None, method):
        engine = _engine(speculative, num_blocks=num_blocks, budget=budget)
        _requests(engine)
        outputs.append(_run(engine))
        assert engine.scheduler.blocks.allocator.num_free == num_blocks  # every block given back
        assert (engine.scheduler.stats.preemptions > 0) == (num_blocks == 16)
    drafts, draft_tokens, accepted = engine.metrics.speculation_counts()
    assert 0 < accepted < draft_tokens  # drafts were kept and rejected
    plans = engine.runner.plans
    assert any(chunk.draft for plan in plans for chunk in plan.chunks)
    assert all(
        len(chunk.token_ids) <= 1 + method.num_speculative_tokens
        for p in plans
        for chunk in p.chunks
        if chunk.draft
    )
    assert outputs[1] == outputs[0]


def test_a_row_after_kept_drafts_counts_them_as_its_outputs():
    """min_tokens: row j of a step reads drafts 1..j as outputs. A model that copies (+50) wants EOS
    after 5 6 7; with min_tokens=2 that EOS is masked at the first output only: the draft row that
    reaches it as the third output must allow it, as the engine without drafts does."""

    outputs = []
    for speculative in (None, SPEC):
        engine = _engine(speculative)
        engine.runner.scores = functools.partial(copy_scores, pull=50.0)
        engine.add_request(
            "eos", [5, 6, 7, EOS, 5, 6, 7, EOS, 5], SamplingParams(max_tokens=20, temperature=0, min_tokens=2)
        )
        engine.add_request(
            "penalty",
            [3] * 5,
            SamplingParams(max_tokens=40, temperature=0, frequency_penalty=2.0, ignore_eos=True),
        )
        outputs.append(_run(engine))
    assert outputs[1] == outputs[0]
    assert outputs[0][("eos", 0)][0] == [6, 7, EOS]
    assert engine.metrics.speculation_counts()[2] > 0


def test_drafts_never_reach_the_prefix_cache():
    """A rejected draft's K/V sit past the sequence's tokens until overwritten; no cached block may
    hold them: a second request over the first's prompt and output reuses its blocks and still gets
    the engine's output without drafts (the fake model reads its context back from the slots)."""
    outputs = []
    for speculative in (None, SPEC):
        engine = _engine(speculative)
        prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
        params = SamplingParams(max_tokens=22, temperature=1.0, seed=2, ignore_eos=True)
        engine.add_request("first", prompt, params)
        first = _run(engine)[("first", 0)][0]
        engine.add_request("second", prompt + first, params)
        outputs.append((first, _run(engine), engine.scheduler.blocks.prefix_hits))
    assert outputs[1][2] >= 24  # the second request read the first's blocks
    assert outputs[1][:2] == outputs[0][:2]


def _brute_force(tokens: list[int], limit: int, config: SpeculativeConfig) -> list[int]:
    """The proposal by its definition: the longest n-gram (max down to min) that ends the tokens and
    occurred earlier, its latest occurrence, what followed it continued as a repeat."""
    length = len(tokens)
    for n in range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1):
        if n >= length:
            continue
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n : end] == tokens[length - n :]:
                extended = list(tokens)
                while len(extended) < end + limit:
                    extended.append(extended[len(extended) - (length - end)])
                return extended[end : end + limit]
    return []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    cuts=st.lists(st.integers(1, 40), max_size=4),
    lookup=st.tuples(st.integers(1, 4), st.integers(0, 2)),
    limit=st.integers(0, 6),
)
def test_the_incremental_index_proposes_what_the_definition_says(tokens, cuts, lookup, limit):
    config = SpeculativeConfig(
        num_speculative_tokens=5, prompt_lookup_min=lookup[0], prompt_lookup_max=lookup[0] + lookup[1]
    )
    proposer = NgramProposer(config)
    seq = Sequence("r", tokens[:1], SamplingParams())
    for end in sorted({*cuts, len(tokens)}):  # the sequence grows between proposals, as it decodes
        if end > len(tokens):
            continue
        seq.output_ids[:] = tokens[1:end]
        got = proposer.propose(seq, limit)
        assert got == _brute_force(tokens[:end], min(limit, 5), config)


def test_the_config_takes_vllms_json_and_names_what_is_wrong():
    parse = SpeculativeConfig.parse
    assert parse('{"method": "ngram", "num_speculative_tokens": 3}') == SpeculativeConfig(3, 5, 5)
    assert parse({"num_speculative_tokens": 2, "prompt_lookup_max": 4}) == SpeculativeConfig(2, 4, 4)
    assert (
        parse({"method": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_min": 2}).prompt_lookup_max
        == 2
    )
    cases = {
        "{": "not JSON",
        "[1]": "JSON object",
        '{"num_speculative_tokens": 3, "model": "x"}': "unknown key(s) model",
        '{"method": "eagle", "num_speculative_tokens": 3}': "method 'eagle' is not supported",
        '{"method": "ngram"}': "needs num_speculative_tokens",
        '{"num_speculative_tokens": 0}': "num_speculative_tokens must be an integer in [1, 64]",
        '{"num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3}': "must be <=",
        '{"num_speculative_tokens": true}': "integer",
    }
    for text, words in cases.items():
        with pytest.raises(ConfigError, match="--speculative-config") as err:
            parse(text)
        assert words in str(err.value) and "\n" not in str(err.value)


def test_speculation_with_async_scheduling_is_refused():
    from shiftlm.serve.options import ServeOptions

    spec = json.dumps({"num_speculative_tokens": 3})
    with pytest.raises(ConfigError, match="cannot be combined"):
        ServeOptions(model="x", speculative_config=spec, async_scheduling=True)._check_flags()
    config = SchedulerConfig(num_blocks=8, block_size=4, max_model_len=16, speculative=SPEC)
    with pytest.raises(ValueError, match="async_scheduling"):
        Engine(SlotRunner(8, 4), config, LetterTokenizer(), {EOS}, VOCAB, async_scheduling=True)


def test_the_metrics_count_drafts_and_kept_tokens():
    from shiftlm.serve.engine.metrics import ServingMetrics, StatsLogger

    engine = _engine(SPEC)
    engine.add_request("r", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], SamplingParams(max_tokens=20, temperature=0))
    _run(engine)
    drafts, tokens, accepted = engine.metrics.speculation_counts()
    text = engine.metrics.render({}, {})
    assert f"shiftlm_spec_decode_num_drafts_total {drafts}" in text
    assert f"shiftlm_spec_decode_num_accepted_tokens_total {accepted}" in text
    assert "spec_decode" not in ServingMetrics().render({}, {})  # a server that never drafts

    class Log:
        def info(self, line):
            self.line = line

    log = Log()
    StatsLogger(engine, log).tick()
    assert f"draft acceptance rate {100 * accepted / tokens:.1f}%" in log.line


NGRAM_JSON = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize(
    "layout,spec",
    [(dict(), NGRAM_JSON), (dict(tp=1, sp=2), NGRAM_JSON), (dict(), {"method": "suffix"})],
    ids=["1rank-ngram", "sp2-shift-ngram", "1rank-suffix"],
)
def test_the_model_gives_the_same_tokens_with_drafts_greedy_and_seeded(tmp_path_factory, layout, spec):
    """The real runner: draft chunks are prefill-like chunks whose every row is sampled (and on two
    ranks argmax-only rows for greedy requests); the tokens equal the run without drafts."""
    from shiftlm import LLM
    from shiftlm.serve.engine.tokenizer import write_char_tokenizer
    from shiftlm.tools.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "tiny", "llama-gqa")
    write_char_tokenizer(path, vocab_size=256)
    prompts = ["abcabcabcabc", "hello hello hello", "the cat the cat the"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=4, max_tokens=24, ignore_eos=True, logprobs=1),
    ]
    outputs, counts = [], None
    for speculative_config in (None, spec):
        with LLM(str(path), speculative_config=speculative_config, enforce_eager=True, **layout) as llm:
            runs = [llm.generate(prompts, p) for p in params]
            outputs.append([[o.outputs[0].token_ids for o in run] for run in runs])
            counts = llm._engine.metrics.speculation_counts()
    assert outputs[1] == outputs[0]
    assert counts[2] > 0  # drafts were kept


def test_drafts_never_take_a_running_sequences_turn():
    """With a budget of 8 and 6 decoding sequences, the drafts get what is left after every one of
    them has its token (without the reserve the oldest took 5 each and the newest waited)."""
    engine = _engine(SPEC, budget=8)
    for i in range(6):
        engine.add_request(f"r{i}", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=12, temperature=0))
    _run(engine)
    decoding = [
        plan
        for plan in engine.runner.plans
        if len(plan.chunks) == 6 and all(c.start >= 8 for c in plan.chunks)  # every one decoding
    ]
    assert decoding and all(plan.num_tokens <= 8 for plan in decoding)
    assert any(chunk.draft for plan in decoding for chunk in plan.chunks)


def test_no_drafts_while_more_sequences_run_than_disable_by_batch_size():
    config = SpeculativeConfig.parse(
        {"num_speculative_tokens": 4, "prompt_lookup_max": 3, "disable_by_batch_size": 2}
    )
    engine = _engine(replace(config, prompt_lookup_min=1))
    for i in range(3):
        engine.add_request(
            f"r{i}", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=6 + 4 * i, temperature=0)
        )
    _run(engine)
    plans = engine.runner.plans
    assert not any(chunk.draft for plan in plans if len(plan.chunks) == 3 for chunk in plan.chunks)
    assert any(chunk.draft for plan in plans if len(plan.chunks) <= 2 for chunk in plan.chunks)
    with pytest.raises(ConfigError, match="disable_by_batch_size must be an integer"):
        SpeculativeConfig.parse({"num_speculative_tokens": 2, "disable_by_batch_size": 0})


def test_the_step_log_counts_drafts_and_decode_rows():
    import io

    from shiftlm.serve.engine.metrics import step_record

    engine = _engine(SPEC)
    engine.step_log = io.StringIO()
    engine.add_request("r", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], SamplingParams(max_tokens=20, temperature=0))
    _run(engine)
    records = [json.loads(line) for line in engine.step_log.getvalue().splitlines()]
    drafted = [r for r in records if "drafts" in r]
    assert drafted and all(r["decodes"] == 1 and r["tokens"] == 1 + r["drafts"] for r in drafted)
    assert sum(r.get("drafts", 0) for r in records) == engine.metrics.speculation_counts()[1]
    assert "drafts" not in step_record(engine.runner.plans[0], 0.0, 0.0, None)  # the prompt's step
