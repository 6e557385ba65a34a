from dataclasses import replace

import torch

from shiftlm.serve.engine.sampling import (
    SampleRow,
    apply_penalties,
    filter_logits,
    make_generator,
    sample_rows,
    sample_token,
)
from shiftlm.serve.engine.sequence import SamplingParams
from shiftlm.serve.engine.text import StreamingText
from tests.serve.fakes import LetterTokenizer

LOGITS = torch.tensor([0.0, 3.0, 1.0, 2.5, -1.0])


def test_top_k_keeps_exactly_the_k_largest_logits():
    kept = torch.isfinite(filter_logits(LOGITS, top_k=2, top_p=1.0))
    assert kept.tolist() == [False, True, False, True, False]


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    probs = torch.softmax(LOGITS, -1)
    kept = torch.isfinite(filter_logits(LOGITS, top_k=0, top_p=float(probs[1] + 0.01)))
    assert kept.tolist() == [False, True, False, True, False]
    assert torch.isfinite(filter_logits(LOGITS, 0, 1e-6)).sum() == 1  # the top token always stays


def test_min_p_draws_only_tokens_at_least_min_p_times_as_likely_as_the_top_one():
    # probabilities at temperature 1: [0.03, 0.50, 0.07, 0.30, 0.01]; min_p 0.5 keeps tokens 1 and 3
    draws = [
        sample_token(
            LOGITS,
            SamplingParams(temperature=1.0, min_p=0.5, seed=s),
            make_generator(SamplingParams(seed=s), 0),
        )
        for s in range(300)
    ]
    assert set(draws) == {1, 3}
    # at temperature 2 the distribution is flatter: token 2 (logit 1, vs 3 at the top) comes in
    flat = {sample_token(LOGITS, SamplingParams(temperature=2.0, min_p=0.3), None) for _ in range(300)}
    assert flat == {1, 2, 3}
    plain = {sample_token(LOGITS, SamplingParams(temperature=1.0), None) for _ in range(600)}
    assert {0, 2} <= plain  # without min_p the small ones are drawn too


def test_top_k_one_samples_the_argmax_at_any_temperature():
    params = SamplingParams(temperature=2.0, top_k=1, seed=0)
    assert {sample_token(LOGITS, params, make_generator(params, i)) for i in range(20)} == {1}


def test_temperature_zero_is_greedy():
    assert sample_token(LOGITS, SamplingParams(temperature=0), None) == 1


def test_the_same_seed_draws_the_same_tokens_and_samples_of_one_request_differ():
    params = SamplingParams(temperature=1.0, seed=11)

    def draws(index: int) -> list[int]:
        generator = make_generator(params, index)
        return [sample_token(torch.zeros(50), params, generator) for _ in range(10)]

    assert draws(0) == draws(0) and draws(0) != draws(1)


def test_streamed_text_never_shows_the_start_of_a_stop_string():
    text = StreamingText(LetterTokenizer(), stop=("cd",))
    deltas = [text.update([0, 1, 2][:n]) for n in (1, 2, 3)]
    assert deltas == ["", "a", "b"] and not text.stopped  # the last letter waits: "c" may start "cd"
    assert text.update([0, 1, 2, 3]) == "" and text.stopped and text.text == "ab"


def _row(params: SamplingParams, prompt=(), output=(), generator=None, logits_row=0) -> SampleRow:
    return SampleRow(logits_row, params, generator, prompt, output)


def test_a_temperature_below_the_floor_is_greedy_instead_of_nan():
    params = SamplingParams(temperature=1e-40, seed=1)
    assert params.greedy
    assert sample_rows(LOGITS[None], [_row(params, generator=make_generator(params, 0))]).tokens == [1]


def test_huge_seeds_are_reduced_to_what_a_generator_accepts():
    for seed in (2**64 - 1, 2**64, 2**200):
        params = SamplingParams(seed=seed, n=2)
        draws = [
            sample_rows(LOGITS[None], [_row(params, generator=make_generator(params, i))]) for i in (0, 1)
        ]
        assert all(0 <= d.tokens[0] < 5 for d in draws)


def test_a_row_of_non_finite_logits_falls_back_to_its_argmax():
    logits = torch.tensor([[float("nan"), float("-inf"), 2.0, float("nan"), float("nan")]])
    assert sample_rows(logits, [_row(SamplingParams(temperature=1.0))]).tokens in ([0], [2])


def test_penalties_and_logit_bias_change_exactly_the_tokens_they_name():
    base = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    seen = SampleRow(0, SamplingParams(repetition_penalty=2.0), None, (0,), (2,))
    assert torch.allclose(apply_penalties(base.clone(), [seen], set()), torch.tensor([[1.0, 1.0, -2.0, 0.5]]))
    freq = SampleRow(0, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), None, (1,), (3, 3))
    assert torch.allclose(
        apply_penalties(base.clone(), [freq], set()), torch.tensor([[2.0, 1.0, -1.0, -0.75]])
    )
    bias = SampleRow(0, SamplingParams(logit_bias=((3, 100.0),)), None)
    assert sample_rows(base, [bias]).tokens == [3]  # greedy only after the bias
    min_tokens = SampleRow(0, SamplingParams(temperature=0, min_tokens=2, max_tokens=4), None, (), (1,))
    assert sample_rows(base, [min_tokens], eos_ids={0}).tokens == [1]
    # min_tokens holds back the stop_token_ids too (vLLM's stop set: EOS and stop_token_ids)
    stops = SampleRow(0, SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(1,)), None, (), (1,))
    assert sample_rows(base, [stops], eos_ids={0}).tokens == [3]
    assert sample_rows(base, [replace(stops, output_ids=(1, 3))], eos_ids={0}).tokens == [0]


def test_logprobs_are_the_raw_distributions_and_rows_are_independent():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    rows = [
        _row(SamplingParams(temperature=0, logprobs=2)),
        _row(SamplingParams(temperature=0), logits_row=1),
    ]
    result = sample_rows(logits, rows)
    expected = torch.log_softmax(LOGITS, dim=-1)
    assert result.tokens == [1, 3] and result.logprobs[1] is None
    assert abs(result.logprobs[0].logprob - float(expected[1])) < 1e-6
    assert [token for token, _ in result.logprobs[0].top] == [1, 3]
