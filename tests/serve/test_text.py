"""Incremental detokenization (serve/engine/text.py): the deltas add up to the full decode, characters split
over byte-level tokens are never sent half, and the work per token does not grow with the output."""

from __future__ import annotations

import pytest
from tokenizers import ByteLevelBPETokenizer
from transformers import PreTrainedTokenizerFast

from shiftlm.serve.engine.text import StreamingText

TEXT = "naïve café 日本語のテキスト 🙂🚀 emoji, ünïcödé and plain ascii words.\n" * 4


@pytest.fixture(scope="module")
def byte_bpe() -> PreTrainedTokenizerFast:
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([TEXT[:40]], vocab_size=270, min_frequency=1, show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)


class CountingTokenizer:
    def __init__(self, inner):
        self.inner, self.decoded_ids = inner, 0

    def encode(self, text, add_special_tokens=False):
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, skip_special_tokens=True):
        self.decoded_ids += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_streamed_deltas_equal_the_full_decode_and_never_split_a_character(byte_bpe):
    ids = byte_bpe.encode(TEXT)
    assert any("\ufffd" in byte_bpe.decode([i]) for i in ids)  # the test really splits characters
    text = StreamingText(byte_bpe)
    deltas = [text.update(ids[: n + 1]) for n in range(len(ids))]
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) + text.flush() == byte_bpe.decode(ids) == TEXT


def test_decode_work_per_token_is_constant(byte_bpe):
    ids = byte_bpe.encode(TEXT * 10)
    counting = CountingTokenizer(byte_bpe)
    text = StreamingText(counting, stop=("never appears",))
    for n in range(len(ids)):
        text.update(ids[: n + 1])
    assert counting.decoded_ids < 12 * len(ids)  # re-decoding everything would be ~len(ids)**2 / 2
    assert text.text == TEXT * 10 and not text.stopped


def test_a_stop_string_spanning_tokens_cuts_the_text_at_its_start(byte_bpe):
    ids = byte_bpe.encode(TEXT)
    text = StreamingText(byte_bpe, stop=("テキスト",))
    sent = "".join(text.update(ids[: n + 1]) for n in range(len(ids)) if not text.stopped)
    assert text.stopped and sent + text.flush() == TEXT[: TEXT.index("テキスト")]


@pytest.mark.parametrize("skip, expected", [(True, "abc"), (False, "ab<s>c")])
def test_special_tokens_are_in_the_text_only_when_asked(tmp_path, skip, expected):
    """vLLM's `skip_special_tokens` (the hermes tool-call parser turns it off: its tags are special
    tokens in some vocabularies)."""
    from shiftlm.serve.engine.tokenizer import load_tokenizer, write_char_tokenizer

    write_char_tokenizer(tmp_path, vocab_size=120)
    tokenizer = load_tokenizer(tmp_path)
    bos = tokenizer.convert_tokens_to_ids("<s>")
    ids = (
        tokenizer.encode("ab", add_special_tokens=False)
        + [bos]
        + tokenizer.encode("c", add_special_tokens=False)
    )
    text = StreamingText(tokenizer, skip_special_tokens=skip)
    assert "".join(text.update(ids[: i + 1]) for i in range(len(ids))) + text.flush() == expected
