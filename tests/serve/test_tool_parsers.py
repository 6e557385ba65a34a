"""Tool-call parsers and tool_choice (serve/http/tool_parsers.py, tools.py), without a server: one
answer however a stream splits the reply, what stays content, when each call is sent, the checks of a
request's tools, and earlier calls reaching the chat template. The live server's side: tests/serve/test_tool_calls.py."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftlm.errors import ConfigError
from shiftlm.serve.engine.errors import InvalidRequest
from shiftlm.serve.engine.tokenizer import chat_messages, load_tokenizer, render_chat, write_char_tokenizer
from shiftlm.serve.http.tool_parsers import HermesCalls, Llama3JsonCalls, MistralCalls, PythonicCalls
from shiftlm.serve.http.tools import NamedCall, RequiredCalls, ToolChoice, merge_calls
from shiftlm.serve.options import ServeOptions

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 3},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
# A Hermes-style template in brief: the tools' names, earlier calls with their arguments as JSON (a
# dict: a string would be quoted), and tool results.
TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m.get('tool_calls') %}<assistant>"
    "{% for c in m['tool_calls'] %}<tool_call>{{ c['function']['arguments'] | tojson }}</tool_call>{% endfor %}{{ '\\n' }}"
    "{% elif m['role'] == 'tool' %}<tool id={{ m['tool_call_id'] }}>{{ m['content'] }}\n"
    "{% else %}<{{ m['role'] }}>{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _run(stream, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    """Feed `pieces` as stream deltas: (content, [(name, arguments)]) as the reply carries them."""
    content, items = "", []
    for piece in [*pieces, None]:
        text, calls = stream.feed(piece) if piece is not None else stream.finish()
        content += text
        items += calls
    return content, [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in merge_calls(items)
    ]


def _splits(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


HERMES = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>\n'
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, len(HERMES)), max_size=12))
def test_hermes_gives_one_answer_however_the_stream_splits_it(cuts):
    whole = _run(HermesCalls(), [HERMES])
    assert whole == (
        "Let me look.\n",
        [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "CET"})],
    )
    stream = HermesCalls()
    sent = "".join(stream.feed(piece)[0] for piece in _splits(HERMES, cuts))
    assert "<" not in sent  # content streamed never holds a piece of the tag
    assert _run(HermesCalls(), _splits(HERMES, cuts)) == whole


@pytest.mark.parametrize(
    "text, expected",
    [
        ("no calls, just <b>text</b>", ("no calls, just <b>text</b>", [])),
        ("a <tool_call>{bad json}</tool_call> b", ("a <tool_call>{bad json}</tool_call> b", [])),
        ('<tool_call>{"name": "f", "arguments": {"x": 1}}', ("", [("f", {"x": 1})])),  # unclosed at the end
        ('<tool_call>{"name": "f", "arguments": {"x": ', ('<tool_call>{"name": "f", "arguments": {"x": ', [])),
        ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>', ("", [("f", {"x": 2})])),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', [])),
    ],
    ids=["text", "bad-json", "unclosed", "truncated", "string-arguments", "not-an-object"],
)  # fmt: skip
def test_hermes_text_that_is_not_a_whole_call_stays_content(text, expected):
    assert _run(HermesCalls(), [text]) == expected
    assert _run(HermesCalls(), list(text)) == expected


def test_parallel_tool_calls_false_keeps_the_first_call():
    content, calls = _run(HermesCalls(parallel=False), [HERMES])
    assert [name for name, _ in calls] == ["get_weather"]


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"name": "f", "parameters": {"a": 1}}', ("", [("f", {"a": 1})])),
        ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {}}', ("", [("f", {"a": 1}), ("g", {})])),
        (" Hello {x}", (" Hello {x}", [])),
        ('{"name": "f", "parameters": ', ('{"name": "f", "parameters": ', [])),
        ('{"a": 1}', ('{"a": 1}', [])),  # JSON, not a call
        ('{"name": "f", "parameters": {"a": "}"}}; {"a": 1}', ('{"a": 1}', [("f", {"a": "}"})])),
        ('{"name": "f", "parameters": {"q": "a \\"}\\" b", "p": "c:\\\\"}}; x', ("x", [("f", {"q": 'a "}" b', "p": "c:\\"})])),
        ('{"name": "f", "parameters": {}} ;\n{"name": "g", "parameters": ', ('{"name": "g", "parameters": ', [("f", {})])),
    ],
    ids=["one", "tag-and-two", "content", "truncated", "not-a-call", "then-not-a-call", "escapes", "then-truncated"],
)  # fmt: skip
def test_llama3_json_calls(text, expected):
    assert _run(Llama3JsonCalls(), [text]) == expected
    assert _run(Llama3JsonCalls(), list(text)) == expected


CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "CET"})]
# The new parsers' replies with CALLS (parser, text, content), and where each call's text closes: the
# stream sends it there
REPLIES = {
    "llama3_json": (
        Llama3JsonCalls,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
        '{"name": "get_time", "parameters": {"zone": "CET"}}',
        "",
    ),
    "mistral": (
        MistralCalls,
        'Checking [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
        "Checking ",
    ),
    "mistral-list": (
        MistralCalls,
        'Checking [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]',
        "Checking ",
    ),
    "pythonic": (PythonicCalls, "[get_weather(city='Paris', days=2), get_time(zone='CET')]", ""),
}
CLOSES = {
    "llama3_json": [REPLIES["llama3_json"][1].index("}}") + 2, len(REPLIES["llama3_json"][1])],
    "mistral": [REPLIES["mistral"][1].index("}") + 1, len(REPLIES["mistral"][1])],
    "mistral-list": [len(REPLIES["mistral-list"][1])] * 2,  # the list is one block
    "pythonic": [REPLIES["pythonic"][1].index(")") + 1, len(REPLIES["pythonic"][1]) - 1],
}


@pytest.mark.parametrize("form", list(REPLIES))
@settings(max_examples=100, deadline=None)
@given(cuts=st.lists(st.integers(0, 200), max_size=12))
def test_each_parser_gives_one_answer_and_sends_each_call_as_its_text_closes(form, cuts):
    parser, text, content = REPLIES[form]
    pieces = _splits(text, cuts)
    assert _run(parser(), [text]) == _run(parser(), pieces) == (content, CALLS)
    stream, fed, sent, streamed = parser(), 0, 0, ""
    for piece in pieces:
        fed += len(piece)
        out, calls = stream.feed(piece)
        streamed, sent = streamed + out, sent + len(calls)
        assert sent == sum(close <= fed for close in CLOSES[form])
    assert streamed == content  # no piece of a tag
    assert _run(parser(parallel=False), pieces) == (content, CALLS[:1])


@pytest.mark.parametrize(
    "text, expected",
    [
        ("no calls, just [text]", ("no calls, just [text]", [])),
        ("[TOOL_CALLS]", ("[TOOL_CALLS]", [])),
        ('[TOOL_CALLS]f[ARGS]{"x": 1', ('[TOOL_CALLS]f[ARGS]{"x": 1', [])),
        ('[TOOL_CALLS]not a name{"x": 1}', ('[TOOL_CALLS]not a name{"x": 1}', [])),
        ('[TOOL_CALLS]f[ARGS][1]', ("[TOOL_CALLS]f[ARGS][1]", [])),
        ('[TOOL_CALLS][{"name": "f", "arguments": {}}, {"x": 1}]', ('[TOOL_CALLS][{"name": "f", "arguments": {}}, {"x": 1}]', [])),
        ('a [TOOL_CALLS]f{"x": 1} b [TOOL_CALLS]g{}\n', ("a  b ", [("f", {"x": 1}), ("g", {})])),
        ('[TOOL_CALLS]bad{x}[TOOL_CALLS]g[ARGS]{"y": "[TOOL_CALLS]"}', ("[TOOL_CALLS]bad{x}", [("g", {"y": "[TOOL_CALLS]"})])),
        ('[TOOL_CALLS] {"name": "f", "arguments": "{\\"x\\": 2}"}', ("", [("f", {"x": 2})])),
    ],
    ids=["text", "marker-alone", "truncated", "bad-name", "not-an-object", "bad-item", "words-between", "bad-then-good", "one-object"],
)  # fmt: skip
def test_mistral_text_that_is_not_a_whole_call_stays_content(text, expected):
    assert _run(MistralCalls(), [text]) == expected
    assert _run(MistralCalls(), list(text)) == expected


def test_mistral_call_ids_are_nine_letters_and_digits_as_vllm_makes_them():
    """Mistral's tokenizers refuse other ids when the calls come back in the next request."""
    items = MistralCalls().feed(REPLIES["mistral"][1])[1] + HermesCalls().feed(HERMES)[1]
    ids = [item["id"] for item in items]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids[:2]) and ids[0] != ids[1]
    assert all(i.startswith("chatcmpl-tool-") for i in ids[2:])  # the other parsers keep vLLM's ids
    assert (
        ToolChoice.of(TOOLS, "auto", "mistral", True).skip_special_tokens(True) is False
    )  # [TOOL_CALLS] kept
    assert ToolChoice.of(TOOLS, "auto", "pythonic", True).skip_special_tokens(True) is True


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[f(a=-1, b=[1.5, {'k': None}], c=True, d='x)y')]", ("", [("f", {"a": -1, "b": [1.5, {"k": None}], "c": True, "d": "x)y"})])),
        ("  [f()]\n", ("", [("f", {})])),
        ("[f(a=1),]", ("", [("f", {"a": 1})])),
        ("Hello [f()]", ("Hello [f()]", [])),
        ("[1, 2]", ("[1, 2]", [])),
        ("[]", ("[]", [])),
        ("[f(x=__import__('os').getcwd())]", ("[f(x=__import__('os').getcwd())]", [])),  # read, never run
        ("[f(x=undefined_name)]", ("[f(x=undefined_name)]", [])),
        ("[f(1)]", ("[f(1)]", [])),  # positional: no name to give the value
        ("[f(**k)]", ("[f(**k)]", [])),
        ("[f(x=1e999)]", ("[f(x=1e999)]", [])),  # inf: JSON has none
        ("[os.f(x=1)]", ("[os.f(x=1)]", [])),
        ("[f(a=1), g(x=y)]", ("g(x=y)]", [("f", {"a": 1})])),
        ("[f(a=1)] Done.", ("Done.", [("f", {"a": 1})])),
        ("[f(a=1), g(b='", ("g(b='", [("f", {"a": 1})])),
    ],
    ids=["literals", "spaces", "trailing-comma", "text-first", "not-calls", "empty", "code", "name", "positional", "kwargs", "inf", "attribute", "then-not-a-call", "then-text", "truncated"],
)  # fmt: skip
def test_pythonic_calls_are_literals_and_anything_else_is_content(text, expected):
    assert _run(PythonicCalls(), [text]) == expected
    assert _run(PythonicCalls(), list(text)) == expected


def test_required_and_named_streams():
    required = '[{"name": "get_time", "parameters": {"zone": "UTC"}}]'
    assert _run(RequiredCalls(), list(required)) == ("", [("get_time", {"zone": "UTC"})])
    assert _run(RequiredCalls(), ['[{"name": "get_ti']) == ('[{"name": "get_ti', [])  # cut by max_tokens
    named = NamedCall("get_time")
    first, rest = named.feed('{"zone"'), named.feed(': "UTC"}')
    assert first[1][0]["function"] == {"name": "get_time", "arguments": '{"zone"'} and "id" in first[1][0]
    assert rest[1] == [{"index": 0, "function": {"arguments": ': "UTC"}'}}]


@pytest.mark.parametrize(
    "tools, choice, parser, message",
    [
        ([], None, "hermes", "tools must not be empty"),
        (None, "required", "hermes", "tool_choice needs tools"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "'nope', which is not in tools"),
        (TOOLS, "auto", None, "--enable-auto-tool-choice and --tool-call-parser"),
        (TOOLS, None, None, "--enable-auto-tool-choice"),  # tools without tool_choice: auto, as OpenAI
        ([{"type": "function", "function": {"name": "a b"}}], "required", None, "tool name 'a b' must be"),
    ],
    ids=["empty", "no-tools", "unknown-name", "auto-off", "default-auto", "bad-name"],
)
def test_tool_choice_misuse_names_the_fix(tools, choice, parser, message):
    with pytest.raises(InvalidRequest, match=message):
        ToolChoice.of(tools, choice, parser, True)


def test_auto_tool_choice_needs_a_known_parser():
    with pytest.raises(
        ConfigError, match="--enable-auto-tool-choice needs --tool-call-parser: one of hermes"
    ):
        ServeOptions(model="m", enable_auto_tool_choice=True)._check_flags()
    with pytest.raises(
        ConfigError, match="--tool-call-parser 'granite' is not one of hermes, llama3_json, mistral, pythonic"
    ):
        ServeOptions(model="m", enable_auto_tool_choice=True, tool_call_parser="granite")._check_flags()


def test_earlier_calls_reach_the_template_with_their_arguments_as_objects(tmp_path):
    conversation = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    write_char_tokenizer(tmp_path, vocab_size=250)
    tokenizer = load_tokenizer(tmp_path)
    text = render_chat(tokenizer, chat_messages(conversation), TEMPLATE, tools=TOOLS)
    assert text == (
        "<tools>get_weather;get_time;</tools>\n<user>weather?\n"
        '<assistant><tool_call>{"city": "Rome"}</tool_call>\n<tool id=c1>sunny\n<assistant>'
    )
    bad = [
        conversation[0],
        {**conversation[1], "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]},
    ]
    with pytest.raises(
        InvalidRequest, match="message 1: tool call 0 needs function.name and function.arguments"
    ):
        chat_messages(bad)
