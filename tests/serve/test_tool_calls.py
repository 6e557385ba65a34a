"""Tool calling on /v1/chat/completions (serve/http/tools.py): the parsers give one answer however the
text is split into stream deltas; a named or `required` tool_choice holds a random model's reply to
the tools' schemas; `auto` finds the calls in the reply; earlier calls and tool results reach the chat
template; every misuse is a 400 naming the field; a reasoning model's thinking goes to
`reasoning_content` before its calls are parsed. The server is started as users start it, with
vLLM's `--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`, and driven
with the openai client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftlm.errors import ConfigError
from shiftlm.serve.engine.errors import InvalidRequest
from shiftlm.serve.engine.tokenizer import chat_messages, load_tokenizer, render_chat, write_char_tokenizer
from shiftlm.serve.http.tools import (
    HermesCalls,
    Llama3JsonCalls,
    NamedCall,
    RequiredCalls,
    ToolChoice,
    merge_calls,
)
from shiftlm.serve.local_server import local_server
from shiftlm.serve.options import ServeOptions
from shiftlm.tools.tiny import make_tiny_checkpoint
from shiftlm.train.tokenizer import copy_tokenizer, train_bpe

MODEL = "tiny-tools"
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
    ],
    ids=["one", "tag-and-two", "content", "truncated", "not-a-call"],
)  # fmt: skip
def test_llama3_json_calls(text, expected):
    assert _run(Llama3JsonCalls(), [text]) == expected
    assert _run(Llama3JsonCalls(), list(text)) == expected


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
    with pytest.raises(ConfigError, match="--tool-call-parser 'mistral' is not one of hermes, llama3_json"):
        ServeOptions(model="m", enable_auto_tool_choice=True, tool_call_parser="mistral")._check_flags()


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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tools") / MODEL, "llama-gqa", vocab_size=320)
    documents = [
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "<tool_call> Rome UTC CET",
        "[1, 2]",
    ]
    copy_tokenizer(train_bpe(documents * 20, 318, tmp_path_factory.mktemp("bpe") / "tok"), path)
    tokenizer = load_tokenizer(path)
    tokenizer.add_tokens(["<think>", "</think>"])  # as Qwen3's: one token each, not special
    tokenizer.save_pretrained(str(path))
    args = ["--model", str(path), "--served-model-name", MODEL, "--num-blocks", "128", "--block-size", "8"]
    args += ["--chat-template", TEMPLATE, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    args += ["--reasoning-parser", "qwen3"]
    with local_server(args, log_path=str(path.parent / "server.log")) as live:
        yield live.url


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _args_ok(name: str, arguments: str) -> bool:
    value = json.loads(arguments)
    if name == "get_weather":
        return (
            set(value) == {"city", "days"} and value["city"] in ("Paris", "Rome") and 1 <= value["days"] <= 3
        )
    return value in ({"zone": "UTC"}, {"zone": "CET"})


MESSAGES = [{"role": "user", "content": "weather in Paris?"}]
COMMON = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=100, temperature=1.0, seed=5)


@pytest.fixture(scope="module")
def think(server) -> tuple[int, int]:
    """The ids of <think> and </think> (one token each, as the fixture added them)."""
    ids = [
        httpx.post(f"{server}/tokenize", json={"prompt": t}, timeout=30).json()["tokens"]
        for t in ("<think>", "</think>")
    ]
    assert [len(i) for i in ids] == [1, 1]
    return ids[0][0], ids[1][0]


@pytest.fixture(scope="module")
def common(think) -> dict:
    """COMMON, with <think> never drawn: the server's reasoning parser holds a grammar until a
    thinking ends, which a random model's seldom does."""
    return {**COMMON, "logit_bias": {str(think[0]): -100}}


def test_a_named_tool_choice_is_a_call_with_valid_arguments_streamed_or_not(server, common):
    client = _client(server)
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(tool_choice=named, n=3, **common)
    for choice in out.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and _args_ok("get_weather", call.function.arguments)
        assert call.id.startswith("chatcmpl-tool-") and choice.message.content is None
        assert choice.finish_reason == "stop"  # as OpenAI and vLLM answer a named choice
    chunks = list(client.chat.completions.create(tool_choice=named, stream=True, **common))
    deltas = [tc for chunk in chunks for c in chunk.choices for tc in (c.delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and len(deltas) > 1  # streamed in pieces
    arguments = "".join(d.function.arguments or "" for d in deltas)
    single = client.chat.completions.create(tool_choice=named, **common)
    assert arguments == single.choices[0].message.tool_calls[0].function.arguments  # same seed, same call


def test_required_gives_calls_of_the_listed_tools(server, common):
    client = _client(server)
    out = client.chat.completions.create(tool_choice="required", n=4, **common)
    for choice in out.choices:  # a random model may go on listing calls until max_tokens
        if choice.finish_reason == "length":
            assert choice.message.tool_calls is None and choice.message.content.startswith('[{"name": "get_')
            continue
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        assert all(_args_ok(c.function.name, c.function.arguments) for c in choice.message.tool_calls)
    assert sum(choice.finish_reason == "tool_calls" for choice in out.choices) >= 2
    one = client.chat.completions.create(tool_choice="required", n=4, parallel_tool_calls=False, **common)
    assert all(len(choice.message.tool_calls) == 1 for choice in one.choices)
    free = client.chat.completions.create(tool_choice="none", n=4, **common)  # the same draws, unconstrained
    assert all(
        choice.message.tool_calls is None and choice.finish_reason != "tool_calls" for choice in free.choices
    )


def test_auto_finds_the_calls_the_model_writes(server, common):
    """The random model is led to write a Hermes call (a regex grammar on top of tool_choice "auto"):
    the parser turns it into content and a call, streamed or not, with finish_reason tool_calls."""
    client = _client(server)
    written = r'Sure\.<tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
    extra = {"structured_outputs": {"regex": written}}
    out = client.chat.completions.create(tool_choice="auto", extra_body=extra, **common)
    choice = out.choices[0]
    assert choice.message.content == "Sure." and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and _args_ok("get_time", call.function.arguments)
    chunks = list(client.chat.completions.create(stream=True, extra_body=extra, **common))  # auto by default
    content = "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)
    calls = [tc for chunk in chunks for c in chunk.choices for tc in (c.delta.tool_calls or [])]
    assert content == "Sure." and [(c.function.name, c.function.arguments) for c in calls] == [
        (call.function.name, call.function.arguments)
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = client.chat.completions.create(extra_body={"structured_outputs": {"regex": "[a-c]{3}"}}, **common)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "stop"


def test_thinking_goes_to_reasoning_content_and_calls_are_parsed_after_it(server, common, think):
    """The prompt leaves a <think> open (as R1 distills' and Qwen3 *-Thinking templates do), the
    random model is nudged to close it, and a regex grammar, held until then, leads it to a call."""
    client = _client(server)
    written = r'Ok\.<tool_call>\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}</tool_call>'
    opened = dict(
        messages=[*MESSAGES, {"role": "assistant", "content": "<think>"}],
        logit_bias={str(think[1]): 4.0},
        extra_body={
            "structured_outputs": {"regex": written},
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    )
    body = {**common, **opened}
    out = client.chat.completions.create(**body)
    message = out.choices[0].message
    assert message.reasoning_content and message.content == "Ok."
    assert [c.function.name for c in message.tool_calls] == ["get_time"]
    chunks = list(client.chat.completions.create(stream=True, **body))
    deltas = [c.delta for chunk in chunks for c in chunk.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == "Ok."
    hidden_body = {**body, "extra_body": {**body["extra_body"], "include_reasoning": False}}
    hidden = client.chat.completions.create(**hidden_body)
    assert hidden.choices[0].message.reasoning_content is None and hidden.choices[0].message.content == "Ok."
    plain = client.chat.completions.create(extra_body={"structured_outputs": {"regex": "[a-c]{3}"}}, **common)
    assert plain.choices[0].message.reasoning_content is None  # qwen3: no <think>, all answer


def test_a_grammar_holds_the_answer_after_the_thinking(server, think):
    """With a reasoning parser the grammar waits for `</think>` (vLLM's behaviour): the thinking is
    free text and the answer keeps to the schema. The prompt leaves a <think> open (as R1 distills'
    and Qwen3 *-Thinking templates do); `</think>` is favoured so that a random model ends its thinking."""
    client = _client(server)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    opened = [*MESSAGES, {"role": "assistant", "content": "<think>"}]
    out = client.chat.completions.create(
        model=MODEL,
        messages=opened,
        n=3,
        max_tokens=60,
        temperature=1.0,
        seed=11,
        logit_bias={str(think[1]): 4.0},
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        # ignore_eos: a random model may draw EOS while it thinks, which ends the reply there
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "ignore_eos": True},
    )
    for choice in out.choices:
        assert choice.message.reasoning_content  # free text before </think>: no grammar held it
        assert json.loads(choice.message.content) in ({"ok": True}, {"ok": False}), choice.message
    # no <think> in the prompt: the reply may open one (allowed beside the grammar's first tokens) or answer at once
    free = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=4, max_tokens=60, temperature=1.0, seed=3,
        logit_bias={str(think[0]): 3.0, str(think[1]): 4.0}, extra_body={"ignore_eos": True},
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )  # fmt: skip
    for choice in free.choices:
        assert json.loads(choice.message.content) in ({"ok": True}, {"ok": False}), choice.message
    thought = [bool(choice.message.reasoning_content) for choice in free.choices]
    assert any(thought) and not all(thought)  # some opened a <think>, some answered at once


def test_a_conversation_with_calls_and_results_renders_and_answers(server):
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "noon"},
    ]
    body = {"model": MODEL, "messages": messages, "tools": TOOLS}
    ids = httpx.post(f"{server}/tokenize", json=body, timeout=30).json()["tokens"]
    rendered = httpx.post(f"{server}/detokenize", json={"model": MODEL, "tokens": ids}, timeout=30).json()[
        "prompt"
    ]
    assert rendered.endswith(
        '<assistant><tool_call>{"zone": "UTC"}</tool_call>\n<tool id=c1>noon\n<assistant>'
    )
    assert rendered.startswith("<tools>get_weather;get_time;</tools>")
    out = _client(server).chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=5
    )
    assert out.choices[0].message.role == "assistant" and out.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]}, "tools"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": []}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, None),  # pydantic's 400 for a type outside the enum
        ({"tool_choice": "sometimes"}, None),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]}, "messages"),
    ],
    ids=["unknown-name", "bad-schema", "with-response-format", "empty", "bad-type", "bad-choice", "bad-arguments"],
)  # fmt: skip
def test_a_misused_tool_field_is_a_400_naming_it(server, extra, param):
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 2, **extra}
    response = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    if param is not None:
        assert response.json()["error"]["param"] == param, response.text
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200
