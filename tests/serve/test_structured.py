"""Structured outputs (serve/engine/structured.py): every sample of a random model, sampled at
temperature 1, is what its grammar allows (a JSON schema, a regex, a choice), through the offline API
(one rank and a 2-rank shift group, asynchronous scheduling) and through the OpenAI server
(`response_format`, vLLM's `structured_outputs`); a bad grammar is a 400 naming the field. The model
has a real byte-level BPE tokenizer (what llguidance reads; the character tokenizer of the other
tests has no braces)."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
import torch

from shiftlm.serve.engine.errors import InvalidRequest
from shiftlm.serve.engine.sampling import grammar_mask
from shiftlm.serve.local_server import local_server
from shiftlm.tools.tiny import make_tiny_checkpoint
from shiftlm.train.tokenizer import copy_tokenizer, train_bpe

MODEL = "tiny-bpe"
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["x", "yz"]}},
    "required": ["ok", "tag"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("so") / MODEL, "llama-gqa", vocab_size=320)
    documents = ['{"name": "x", "count": 3, "ok": true}', "abc abd yes no", "[1, 2, 3]"] * 20
    copy_tokenizer(train_bpe(documents, 320, tmp_path_factory.mktemp("bpe") / "tok"), path)
    return path


def _valid_json(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return set(value) == {"ok", "tag"} and isinstance(value["ok"], bool) and value["tag"] in ("x", "yz")


def _texts(outputs) -> list[str]:
    return [sample.text for out in outputs for sample in out.outputs]


def test_grammar_mask_leaves_exactly_the_allowed_tokens():
    x = torch.zeros(3, 40)
    allowed = torch.zeros(2, dtype=torch.int32)
    allowed[0] = (1 << 3) - (1 << 31)  # tokens 3 and 31 (bit 31: an int32's sign bit)
    allowed[1] = 1 << 2  # token 34
    out = grammar_mask(x, [1], [allowed])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [3, 31, 34]
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all()  # rows without a grammar


@pytest.mark.parametrize(
    "layout", [dict(), dict(tp=1, sp=2), dict(async_scheduling=True)], ids=["1rank", "sp2-shift", "async"]
)
def test_every_sample_keeps_to_its_grammar(model_dir, layout):
    from shiftlm import LLM, SamplingParams, StructuredOutputsParams

    def params(**spec):
        return SamplingParams(
            n=3, temperature=1.0, seed=1, max_tokens=60, structured_outputs=StructuredOutputsParams(**spec)
        )

    with LLM(str(model_dir), **layout) as llm:
        as_json = llm.generate(["hello", "x"], params(json=SCHEMA))
        as_regex = llm.generate(["hello"], params(regex="[a-c]{2,4}"))
        as_choice = llm.generate(["hello"], params(choice=["yes", "no"]))
        greedy = SamplingParams(
            temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex="[a-c]{2,4}")
        )
        as_regex += llm.generate(["hello", "x"], greedy)  # greedy: the argmax of the masked logits
        free = llm.generate(["hello", "x"], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=60))
    assert all(_valid_json(text) for text in _texts(as_json)), _texts(as_json)
    assert all(text == json.dumps(json.loads(text)) for text in _texts(as_json))  # ", " and ": " only
    assert all(re.fullmatch("[a-c]{2,4}", text) for text in _texts(as_regex)), _texts(as_regex)
    assert all(text in ("yes", "no") for text in _texts(as_choice))
    finished = [s.finish_reason for out in as_json + as_regex + as_choice for s in out.outputs]
    assert set(finished) == {"stop"}  # each ended because its grammar was complete (or EOS)
    assert not any(_valid_json(text) for text in _texts(free))  # the same draws, unconstrained


def test_drafts_are_verified_only_as_far_as_the_grammar_takes_them(model_dir):
    """Speculative decoding with a grammar: each verified row is masked by the grammar after the drafts
    before it, a draft the grammar refuses (and what follows) is not verified, and the matcher is
    where it was. Suffix decoding drafts the JSON's structure from earlier outputs: seeded samples at
    temperature 1 are the same with and without drafts, and every one keeps to the schema."""
    from shiftlm import LLM, SamplingParams, StructuredOutputsParams

    grammar = StructuredOutputsParams(json=SCHEMA)
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=40, structured_outputs=grammar)
        for seed in range(6)
    ]
    texts, counts = [], None
    for spec in (None, {"method": "suffix"}):
        with LLM(str(model_dir), speculative_config=spec, enforce_eager=True) as llm:
            texts.append([llm.generate("hello", p)[0].outputs[0].text for p in params])  # one after another
            counts = llm._engine.metrics.speculation_counts()
    assert texts[1] == texts[0]
    assert all(_valid_json(text) for text in texts[0])
    assert counts[2] > 0  # drafts kept


def test_json_separators_are_fixed_unless_any_whitespace_is_asked(model_dir):
    """By default a JSON grammar takes exactly ", " and ": " between tokens (free whitespace let the
    quickstart model spend max_tokens on newlines); `--structured-outputs-any-whitespace` takes any."""
    from shiftlm.serve.engine.structured import Grammars, StructuredOutputsParams
    from shiftlm.serve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)

    def takes(grammars, text):
        matcher = grammars.matcher(StructuredOutputsParams(json=SCHEMA))
        try:
            for token in tokenizer.encode(text, add_special_tokens=False):
                matcher.accept(token)
        except RuntimeError:  # the grammar rejected a token
            return False
        return True

    texts = ['{"ok": true, "tag": "x"}', '{"ok":true,"tag":"x"}', '{\n  "ok": true, "tag": "x"}']
    fixed, free = (Grammars(tokenizer, 320, {2}, json_any_whitespace=w) for w in (False, True))
    assert [takes(fixed, text) for text in texts] == [True, False, False]
    assert [takes(free, text) for text in texts] == [True, True, True]


def test_a_bad_grammar_is_refused_before_anything_runs(model_dir):
    from shiftlm import LLM, SamplingParams, StructuredOutputsParams

    with LLM(str(model_dir)) as llm:
        for spec, message in [
            (dict(regex="a("), "the regex grammar does not compile: .*unclosed group"),
            (dict(json={"type": "bogus"}), "the json_schema grammar does not compile"),
            (dict(json="[1, 2]"), "json is a JSON schema"),
            (dict(regex="a", choice=["b"]), r"exactly one of .*\['regex', 'choice'\]"),
            (dict(), "exactly one of"),
        ]:
            with pytest.raises(InvalidRequest, match=message):
                llm.generate(["a"], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))
        assert not llm._engine.has_work()


@pytest.fixture(scope="module")
def server(model_dir):
    args = [
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL,
        "--num-blocks",
        "64",
        "--block-size",
        "8",
    ]
    with local_server(args, log_path=str(model_dir.parent / "server.log")) as live:
        yield live.url


def test_openai_response_format_and_vllm_structured_outputs(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)
    common = dict(model=MODEL, max_tokens=60, temperature=1.0, seed=3, n=2)
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    out = client.chat.completions.create(
        messages=[{"role": "user", "content": "hi"}], response_format=schema, **common
    )
    assert all(_valid_json(choice.message.content) for choice in out.choices)
    anything = client.completions.create(  # completions: vLLM's extension, through extra_body
        prompt="a", extra_body={"response_format": {"type": "json_object"}}, **common
    )
    assert all(choice.text.startswith("{") for choice in anything.choices)
    regex = client.completions.create(
        prompt="a", extra_body={"structured_outputs": {"regex": "[a-c]{2,4}"}}, **common
    )
    assert all(re.fullmatch("[a-c]{2,4}", choice.text) for choice in regex.choices)
    stream = client.completions.create(
        prompt="a", stream=True, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}, **common
    )
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert all(text in ("yes", "no") for text in texts)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "bogus"}}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format"),
        ({"response_format": {"type": "xml"}}, None),  # pydantic's 400 for a value outside the enum
        ({"structured_outputs": {"regex": "a("}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
        ({"guided_regex": "a"}, "guided_regex"),  # vLLM's older field: the 400 names its successor
    ],
    ids=["bad-schema", "no-schema", "bad-type", "bad-regex", "both", "guided"],
)  # fmt: skip
def test_a_bad_grammar_is_a_400_naming_the_field(server, extra, param):
    body = {"model": MODEL, "prompt": "a", "max_tokens": 2, **extra}
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    if param is not None:
        assert response.json()["error"]["param"] == param
    if param == "guided_regex":
        assert "send structured_outputs: {'regex': ...} instead" in response.json()["error"]["message"]
    streams = {"model": MODEL, "prompt": "a", "streams": [{}, {}], "structured_outputs": {"regex": "a"}}
    refused = httpx.post(f"{server}/v1/streams", json=streams, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "structured_outputs"
