"""POST /v1/streams through the real app (FastAPI + AsyncEngine + a one-rank model runner, in process):
JSON and SSE give the HF reference's tokens per stream; bad groups are 400s with the reason while
ordinary requests keep being served; OpenAI's n > 1 runs as an `isolated` group."""

from __future__ import annotations

import json

import pytest

from shiftlm.serve.engine.async_engine import AsyncEngine
from shiftlm.serve.engine.core import Engine
from shiftlm.serve.engine.scheduler import SchedulerConfig
from shiftlm.serve.http.app import ApiOptions, build_app
from tests.serve.fakes import LetterTokenizer
from tests.serve.stream_reference import hf_model, make_position_sensitive_checkpoint, reference

PROMPT, PREFIXES, MAX_TOKENS = [5, 17, 33, 2, 9, 100, 7], [[11, 12], [40], [99, 98, 97]], [4, 3, 5]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from fastapi.testclient import TestClient

    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    model_dir = make_position_sensitive_checkpoint(tmp_path_factory.mktemp("streams-api"))
    runner = ModelRunner.load(model_dir, Mesh(ParallelConfig()), num_blocks=32, block_size=4)
    config = SchedulerConfig(num_blocks=32, block_size=4, max_tokens_per_step=16, max_model_len=64)
    engine = AsyncEngine(Engine(runner, config, LetterTokenizer(), eos_token_ids=set(), vocab_size=250))
    with TestClient(build_app(engine, LetterTokenizer(), ApiOptions(model_name="m"))) as client:
        yield client, hf_model(model_dir)
    engine.shutdown()


def body(layout="timestep", **fields):
    streams = [{"prefix": p, "max_tokens": m} for p, m in zip(PREFIXES, MAX_TOKENS)]
    return {"model": "m", "prompt": PROMPT, "streams": streams, "layout": layout, "temperature": 0,
            "ignore_eos": True, **fields}  # fmt: skip


@pytest.mark.parametrize("layout", ["isolated", "timestep", "hogwild"])
def test_json_and_sse_give_every_stream_the_reference_tokens(setup, layout):
    client, model = setup
    expected = reference(model, layout, PROMPT, PREFIXES, MAX_TOKENS)
    response = client.post("/v1/streams", json=body(layout))
    assert response.status_code == 200, response.text
    result = response.json()
    assert [s["token_ids"] for s in result["streams"]] == expected
    assert [s["index"] for s in result["streams"]] == [0, 1, 2]
    assert all(s["finish_reason"] == "length" for s in result["streams"])
    assert result["usage"]["completion_tokens"] == sum(MAX_TOKENS)
    assert result["usage"]["prompt_tokens"] == len(PROMPT) + sum(map(len, PREFIXES))
    streamed: dict[int, list[int]] = {}
    with client.stream("POST", "/v1/streams", json=body(layout, stream=True)) as events:
        lines = [line[6:] for line in events.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    for chunk in chunks:
        for entry in chunk["streams"]:
            streamed.setdefault(entry["index"], []).extend(entry["token_ids"])
    assert [streamed[k] for k in range(3)] == expected
    assert chunks[-1]["usage"]["completion_tokens"] == sum(MAX_TOKENS)


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"streams": []}, "streams is empty"),
        ({"streams": [{"prefix": [1], "max_tokens": 30}] * 5}, "too many streams for the cache"),
        ({"streams": [{"prefix": [1], "max_tokens": 60}]}, "streams[0]: prompt + prefix + max_tokens = 68"),
        ({"streams": [{"prefix": [1]}] * 17}, "too many streams: 17"),
        (
            {"streams": [{"prefix": [1]}, {"prefix": [2], "max_tokens": 0}]},
            "streams[1]: max_tokens must be >= 1",
        ),
        ({"streams": [{"prefix": [1]}, {"prefix": [2], "top_p": 0.5}]}, "streams.1.top_p"),
        ({"layout": "braided"}, "unknown layout 'braided'"),
    ],
)
def test_a_bad_group_is_a_400_with_the_reason_and_other_requests_are_served(setup, change, reason):
    client, _ = setup
    response = client.post("/v1/streams", json={**body(), **change})
    assert response.status_code == 400
    assert reason in response.json()["error"]["message"]
    ok = client.post(
        "/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_openai_n_samples_are_the_isolated_streams_of_the_same_seeds(setup):
    client, _ = setup
    fields = {
        "model": "m",
        "prompt": PROMPT,
        "max_tokens": 5,
        "temperature": 1.0,
        "seed": 5,
        "ignore_eos": True,
    }
    completions = client.post("/v1/completions", json={**fields, "n": 3, "logprobs": 0}).json()["choices"]
    body = {**fields, "layout": "isolated", "streams": [{}, {}, {}]}
    streams = client.post("/v1/streams", json=body).json()["streams"]
    assert len({tuple(s["token_ids"]) for s in streams}) == 3  # seed + k: the samples differ
    # each choice k is stream k: the same tokens (logprobs of a sampled token tell them apart)
    for k in range(3):
        alone = client.post("/v1/streams", json={**body, "streams": [{"seed": 5 + k}]}).json()["streams"][0]
        assert alone["token_ids"] == streams[k]["token_ids"]
        choice = next(c for c in completions if c["index"] == k)
        same_seed = client.post("/v1/completions", json={**fields, "seed": 5 + k, "logprobs": 0}).json()
        expected = same_seed["choices"][0]["logprobs"]["token_logprobs"]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, rel=1e-5)
