"""Tool calling on /v1/chat/completions (serve/http/tools.py; its parsers alone: test_tool_parsers.py):
a named or `required` tool_choice holds a random model's reply to the tools' schemas; `auto` finds the calls in the reply; earlier calls and tool results reach the chat
template; every misuse is a 400 naming the field; a reasoning model's thinking goes to
`reasoning_content` before its calls are parsed. The server is started as users start it, with
vLLM's `--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`, and driven
with the openai client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from shiftlm.serve.engine.tokenizer import load_tokenizer
from shiftlm.serve.local_server import local_server
from shiftlm.tools.tiny import make_tiny_checkpoint
from shiftlm.train.tokenizer import copy_tokenizer, train_bpe
from tests.serve.test_tool_parsers import TEMPLATE, TOOLS

MODEL = "tiny-tools"


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
