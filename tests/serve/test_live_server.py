"""The real `openai` client against a live `shiftlm serve` (2 gloo ranks, shift mode) on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest

from shiftlm.serve.engine.tokenizer import write_char_tokenizer
from shiftlm.serve.local_server import LocalServer, local_server
from shiftlm.tools.tiny import make_tiny_checkpoint

MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / MODEL, "llama-gqa")
    write_char_tokenizer(model_dir, vocab_size=250)
    return model_dir


@pytest.fixture(scope="module")
def live(model_dir) -> LocalServer:
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
        "--served-model-name",
        MODEL,
    ]
    with local_server(args, log_path=str(model_dir.parent / "server.log")) as live:
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
    out = client.completions.create(stop=[stop, "never"], **kwargs).choices[0]
    assert out.text == full[: full.find(stop)] and out.finish_reason == "stop"
    assert out.stop_reason == stop  # vLLM's field: which stop string ended it
    stream = client.completions.create(stop=[stop], stream=True, **kwargs)
    last = [chunk.choices[0] for chunk in stream if chunk.choices][-1]
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert client.completions.create(**kwargs).choices[0].stop_reason is None  # length


@pytest.mark.parametrize(
    "body,status",
    [
        ({"model": "nope", "prompt": "a"}, 404),
        ({"model": MODEL, "prompt": "a", "temperature": 9}, 400),
        ({"model": MODEL, "prompt": "a", "n": "many"}, 400),
        ({"model": MODEL, "prompt": "a" * 5000}, 400),
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


def test_echo_logprobs_of_the_prompt_match_hf_transformers(client, model_dir):
    """lm-eval's loglikelihood request: echo=True, logprobs=1, max_tokens=0 scores the prompt only."""
    import torch
    import transformers

    prompt = [5, 17, 42, 99, 3, 200, 7, 64, 128, 11, 12, 13]  # 12 tokens > threshold 8: SP x TP prefill
    out = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    choice = out.choices[0]
    assert out.usage.completion_tokens == 0 and len(choice.logprobs.token_logprobs) == len(prompt)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    expected = [logprobs[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    assert choice.logprobs.token_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(choice.logprobs.token_logprobs[1:], expected)) < 1e-4
    top = choice.logprobs.top_logprobs[1]
    assert len(top) == 1 and abs(next(iter(top.values())) - logprobs[0].max().item()) < 1e-4


def test_completion_logprobs_give_the_chosen_tokens_and_the_top_k(client):
    out = client.completions.create(
        model=MODEL,
        prompt="logprobs",
        max_tokens=4,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(len(top) == 3 for top in lp.top_logprobs)
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert abs(value - max(top.values())) < 1e-6  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_and_top_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(len(item.top_logprobs) == 2 and item.logprob <= 0 for item in content)


def test_a_list_of_prompts_gets_n_choices_per_prompt_in_order(client):
    prompts = ["first prompt", "second"]
    kwargs = dict(model=MODEL, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    out = client.completions.create(prompt=prompts, n=2, **kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    alone = [client.completions.create(prompt=p, **kwargs).choices[0].text for p in prompts]
    assert [c.text for c in out.choices] == [alone[0], alone[0], alone[1], alone[1]]
    ids = client.completions.create(prompt=[[5, 6, 7], [8, 9]], **kwargs)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5


def test_logit_bias_forces_a_token(client, model_dir):
    import transformers

    token = transformers.AutoTokenizer.from_pretrained(model_dir).decode([60])
    kwargs = dict(model=MODEL, prompt="bias", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    forced = client.completions.create(logit_bias={"60": 100}, logprobs=0, **kwargs).choices[0]
    assert forced.logprobs.tokens == [token] * 6
    banned = client.completions.create(logit_bias={"60": -100}, logprobs=0, **kwargs).choices[0]
    assert token not in banned.logprobs.tokens


def test_greedy_with_frequency_and_presence_penalties_picks_the_best_penalised_token(client):
    """Each chosen token maximises logprob - frequency * count - presence * [count > 0] over the top 20
    (logprobs are the model's raw ones; the penalties are additive, so the order is the logits')."""
    frequency, presence = 1.5, 0.5
    out = client.completions.create(
        model=MODEL, prompt="aaaa", max_tokens=16, temperature=0, logprobs=20, frequency_penalty=frequency,
        presence_penalty=presence, extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp, counts, overridden = out.choices[0].logprobs, Counter(), 0
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):

        def score(t, raw):
            return raw - frequency * counts[t] - presence * (counts[t] > 0)

        assert all(score(token, value) >= score(t, raw) - 1e-4 for t, raw in top.items())
        overridden += value < max(top.values()) - 1e-6
        counts[token] += 1
    plain = client.completions.create(
        model=MODEL, prompt="aaaa", max_tokens=16, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
    ).choices[0]
    if len(set(plain.logprobs.tokens)) < 16:  # plain greedy repeats itself: the penalties must show
        assert overridden > 0 and len(set(lp.tokens)) > len(set(plain.logprobs.tokens))
    rep = client.completions.create(
        model=MODEL, prompt="aaaa", max_tokens=4, extra_body={"ignore_eos": True, "repetition_penalty": 1.3}
    )
    assert rep.usage.completion_tokens == 4


def test_min_tokens_holds_back_eos(client, model_dir):
    eos = 2  # write_char_tokenizer's </s>
    out = client.completions.create(
        model=MODEL, prompt="e", max_tokens=5, temperature=0, logit_bias={str(eos): 100},
        extra_body={"min_tokens": 3},
    )  # fmt: skip
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "stop"


def test_stop_token_ids_end_a_reply_and_are_not_in_its_text(client, model_dir):
    """vLLM's `stop_token_ids` (extra body): the reply stops at the first one drawn, with "stop", even
    with ignore_eos; its text is what the tokens before it say."""
    from transformers import AutoTokenizer

    greedy = dict(model=MODEL, prompt="e", max_tokens=8, temperature=0)
    free = client.completions.create(**greedy, logprobs=0, extra_body={"ignore_eos": True})
    drawn = free.choices[0].logprobs.tokens
    stop_at = next(i for i in range(1, len(drawn)) if drawn[i] not in drawn[:i])
    stop_id = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids(drawn[stop_at])
    out = client.completions.create(**greedy, extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert out.choices[0].finish_reason == "stop" and out.choices[0].stop_reason == stop_id  # vLLM's field
    assert out.usage.completion_tokens == stop_at + 1 and out.choices[0].text == "".join(drawn[:stop_at])


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"logprobs": 50}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop_token_ids": [3, 1_000_000]}, "stop_token_ids"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_unimplemented_or_out_of_range_fields_are_400s_naming_the_field(server, extra, param):
    body = {"model": MODEL, "prompt": "a", "max_tokens": 2, **extra}
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_tokenize_and_detokenize_as_vllm_serves_them(server, model_dir):
    """vLLM's /tokenize (a prompt, or messages through the chat template as /v1/chat/completions
    renders them) and /detokenize, on the server's own tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = httpx.post(
        f"{server}/tokenize", json={"model": MODEL, "prompt": "hello", "return_token_strs": True}
    )
    assert out.status_code == 200
    body = out.json()
    assert body["tokens"] == tokenizer.encode("hello") and body["count"] == len(body["tokens"])
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"]) and body["max_model_len"] > 0
    chat = httpx.post(f"{server}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] == len("<user>hi\n<assistant>")  # as test_chat_uses_the_chat_template counts it
    back = httpx.post(f"{server}/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == tokenizer.decode(body["tokens"])
    for path, bad, param in [
        ("/tokenize", {"model": "nope", "prompt": "a"}, "model"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "messages"),
        ("/tokenize", {}, "prompt"),
        ("/detokenize", {"tokens": [999999]}, "tokens"),
    ]:
        response = httpx.post(f"{server}{path}", json=bad)
        assert response.status_code in (400, 404) and response.json()["error"]["param"] == param, (
            response.text
        )


def test_chat_template_kwargs_and_continue_final_message(server):
    """vLLM's chat fields: `chat_template_kwargs` are template variables (Qwen3's `enable_thinking`),
    `continue_final_message` leaves the last assistant message open; /tokenize renders the same."""

    def count(**fields):
        body = {
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
            **fields,
        }
        response = httpx.post(f"{server}/tokenize", json=body)
        return response.status_code, response.json()

    # the char tokenizer's template ignores unknown variables: same count with or without them
    assert count(chat_template_kwargs={"enable_thinking": False}) == count()
    status, open_ = count(add_generation_prompt=False, continue_final_message=True)
    assert status == 200 and open_["count"] == len("<user>hi\n<assistant>ok")  # no newline after "ok"
    status, error = count(continue_final_message=True)  # with add_generation_prompt: true, a 400
    assert status == 400 and error["error"]["param"] == "continue_final_message"
    status, error = count(chat_template_kwargs={"tokenize": True})
    assert status == 400 and error["error"]["param"] == "chat_template_kwargs"
    reply = httpx.post(
        f"{server}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "assistant", "content": "ok"}], "max_tokens": 2,
              "add_generation_prompt": False, "continue_final_message": True},
    )  # fmt: skip
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == len("<assistant>ok")
