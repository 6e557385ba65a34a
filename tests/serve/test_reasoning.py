"""Reasoning parsers (serve/http/reasoning.py): a reply's thinking and answer come apart the same way
however the stream splits the text, and each parser places a reply without `</think>` where its
models' templates put it. The live server's side is in tests/serve/test_tool_calls.py (one server)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftlm.errors import ConfigError
from shiftlm.serve.http.reasoning import REASONING_PARSERS
from shiftlm.serve.options import ServeOptions


def _split(name: str, pieces: list[str]) -> tuple[str, str]:
    parser, reasoning, content = REASONING_PARSERS[name](), "", ""
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


REPLY = "<think>\nThe user asks x; <b> is not </thin a tag.\n</think>\n\nThe answer is <x>."


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, len(REPLY)), max_size=10), st.sampled_from(sorted(REASONING_PARSERS)))
def test_any_split_of_the_stream_gives_the_whole_reply_s_answer(cuts, name):
    points = sorted(set(cuts))
    pieces = [REPLY[a:b] for a, b in zip([0, *points], [*points, len(REPLY)])]
    expected = ("\nThe user asks x; <b> is not </thin a tag.\n", "\n\nThe answer is <x>.")
    assert _split(name, [REPLY]) == expected
    assert _split(name, pieces) == expected
    parser = REASONING_PARSERS[name]()
    sent = "".join(parser.feed(piece)[0] for piece in pieces)
    assert "</think" not in sent and not sent.startswith("<")  # no piece of a tag goes out


@pytest.mark.parametrize(
    "text, deepseek_r1, qwen3",
    [
        ("plan</think>Answer", ("plan", "Answer"), ("", "plan</think>Answer")),  # R1: the prompt opened it
        ("Just an answer", ("Just an answer", ""), ("", "Just an answer")),  # R1: thinking cut short
        ("<think>cut sh", ("cut sh", ""), ("cut sh", "")),
        ("", ("", ""), ("", "")),
        ("  <thi", ("  <thi", ""), ("", "  <thi")),
    ],
    ids=["no-open-tag", "no-tags", "cut", "empty", "tag-start-only"],
)
def test_a_reply_without_the_closing_tag(text, deepseek_r1, qwen3):
    assert _split("deepseek_r1", list(text)) == deepseek_r1
    assert _split("qwen3", list(text)) == qwen3


def test_an_unknown_reasoning_parser_is_one_line():
    with pytest.raises(ConfigError, match="--reasoning-parser 'r1' is not one of deepseek_r1, qwen3"):
        ServeOptions(model="m", reasoning_parser="r1")._check_flags()
