import torch

from shiftlm.serve.sampling import filter_logits, make_generator, sample_token
from shiftlm.serve.sequence import SamplingParams
from shiftlm.serve.text import StreamingText
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
