"""The real `openai` client against a live `shiftlm serve` (2 gloo ranks, shift mode) on 127.0.0.1."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from shiftlm.model.tiny import make_tiny_checkpoint
from shiftlm.serve.local_server import LocalServer, local_server
from shiftlm.serve.tokenizer import write_char_tokenizer

MODEL = "tiny"


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> LocalServer:
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / MODEL, "llama-gqa")
    write_char_tokenizer(model_dir, vocab_size=250)
    # 24 blocks of 8 tokens hold ~8 of the load test's 200 requests, so it must preempt
    args = [
        "--model",
        str(model_dir),
        "--tp",
        "1",
        "--sp",
        "2",
        "--shift-threshold",
        "8",
        "--num-blocks",
        "24",
        "--block-size",
        "8",
        "--max-tokens-per-step",
        "64",
        "--max-pending",
        "400",
    ]
    with local_server(args, log_path=str(tmp_path_factory.mktemp("log") / "server.log")) as live:
        yield live


@pytest.fixture(scope="module")
def server(live: LocalServer) -> str:
    return live.url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


def test_models_lists_the_served_checkpoint(client):
    assert [model.id for model in client.models.list().data] == [MODEL]


def test_completion_returns_max_tokens_with_usage(client):
    out = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5 and out.usage.prompt_tokens == len("Hello there")


def test_greedy_completion_is_deterministic_and_streaming_yields_the_same_text(client):
    kwargs = dict(model=MODEL, prompt="abc def", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == 8


def test_chat_uses_the_chat_template_and_streams(client):
    messages = [{"role": "user", "content": "hi"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len("<user>hi\n<assistant>")
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == out.choices[0].message.content
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == out.usage.total_tokens


def test_n_samples_come_back_as_n_choices(client):
    out = client.completions.create(
        model=MODEL,
        prompt="x" * 20,
        max_tokens=6,
        n=3,
        temperature=1.0,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 18


def test_a_stop_string_is_cut_from_the_output(client):
    kwargs = dict(
        model=MODEL, prompt="stop here", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    full = client.completions.create(**kwargs).choices[0].text
    stop = full[3:5]
    out = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert out.text == full[: full.find(stop)] and out.finish_reason == "stop"


@pytest.mark.parametrize(
    "body,status",
    [
        ({"model": "nope", "prompt": "a"}, 404),
        ({"model": MODEL, "prompt": "a", "temperature": 9}, 400),
        ({"model": MODEL, "prompt": "a", "n": "many"}, 400),
        ({"model": MODEL, "prompt": "a" * 5000}, 413),
        ({"model": MODEL}, 400),
        ({"model": MODEL, "prompt": [999999]}, 400),
    ],
    ids=["unknown-model", "bad-temperature", "bad-type", "prompt-too-long", "missing-prompt", "bad-token-id"],
)
def test_bad_requests_get_openai_errors(server, body, status):
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
    assert response.status_code == status
    assert response.json()["error"]["message"]


def test_bad_requests_do_not_disturb_concurrent_good_ones(server):
    async def main():
        async with httpx.AsyncClient(base_url=server, timeout=120) as http:
            good = {"model": MODEL, "prompt": "good", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            bad = {"model": MODEL, "prompt": "bad", "top_p": 0}
            calls = [http.post("/v1/completions", json=good if i % 2 else bad) for i in range(10)]
            return await asyncio.gather(*calls)

    responses = asyncio.run(main())
    assert [r.status_code for r in responses] == [400, 200] * 5
    assert len({r.json()["choices"][0]["text"] for r in responses[1::2]}) == 1


def _rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and its descendants (the worker ranks), from /proc (no psutil)."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return rss_kb * 1024 + sum(_rss_bytes(int(child)) for child in children)


def test_200_concurrent_streams_on_a_small_cache_all_finish_and_the_server_stays_up(server, live):
    rss_before = _rss_bytes(live.pid)

    async def stream_one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=_load_prompt(i),
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, usage = "", None
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=300)
        return await asyncio.gather(*(stream_one(client, i) for i in range(200)))

    results = asyncio.run(main())
    assert all(tokens == 16 for _, tokens in results)
    # greedy text does not depend on batching or on having been preempted and recomputed
    assert [results[i][0] for i in (0, 7, 199)] == [_complete_alone(server, i) for i in (0, 7, 199)]
    metrics = httpx.get(f"{server}/metrics", timeout=30).text
    assert "shiftlm_preemptions_total" in metrics
    assert float(_metric(metrics, "shiftlm_preemptions_total")) > 0
    assert float(_metric(metrics, "shiftlm_kv_cache_usage_ratio")) == 0.0  # every block came back
    assert float(_metric(metrics, "shiftlm_num_requests_running")) == 0.0
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200
    # 200 finished requests leave no per-request state behind (generous bound: allocator caching)
    rss_after = _rss_bytes(live.pid)
    assert rss_after < 1.5 * rss_before + 200e6, (rss_before, rss_after)


def _load_prompt(i: int) -> str:
    return f"{i} {i}"  # short prompts, long outputs: sequences outgrow the cache while decoding


def _complete_alone(server: str, i: int) -> str:
    body = {"model": MODEL, "prompt": _load_prompt(i), "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{server}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]


def _metric(text: str, name: str) -> str:
    return next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " "))


def test_metrics_expose_latency_histograms_and_mode_switches(server):
    # a 20-token prompt (> threshold 8: SP x TP) and its decode steps (full TP) give both modes steps
    body = {"model": MODEL, "prompt": "m" * 20, "max_tokens": 3, "ignore_eos": True}
    assert httpx.post(f"{server}/v1/completions", json=body, timeout=120).status_code == 200
    text = httpx.get(f"{server}/metrics", timeout=30).text
    for name in (
        "shiftlm_time_to_first_token_seconds_bucket",
        "shiftlm_inter_token_latency_seconds_count",
        "shiftlm_e2e_request_latency_seconds_sum",
        "shiftlm_mode_switches_total",
        "shiftlm_num_requests_running",
        "shiftlm_generation_tokens_total",
        'shiftlm_step_duration_seconds_count{mode="tp"}',
        'shiftlm_step_tokens_total{mode="sp_tp"}',
    ):
        assert name in text
