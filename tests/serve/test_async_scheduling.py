"""Asynchronous scheduling (issue 34 item 4): step N+1 is scheduled and launched before step N's tokens
are read, its `PENDING` tokens taken from N's draws on the device. Whatever runs ahead, every request's
output equals the synchronous engine's, token for token (greedy, seeded sampling, logprobs, stop
strings, EOS, aborts, preemption, prefix caching), and nothing leaks."""

from __future__ import annotations

import json

import pytest

from shiftlm.serve.engine import sampling
from shiftlm.serve.engine.core import Engine
from shiftlm.serve.engine.scheduler import SchedulerConfig
from shiftlm.serve.engine.sequence import SamplingParams
from shiftlm.serve.plan import PENDING
from tests.serve.fakes import EOS, VOCAB, LetterTokenizer, reference_greedy
from tests.serve.test_engine import _engine as engine_with


def _engine(async_scheduling, events=None, **options) -> Engine:
    engine = engine_with(async_scheduling=async_scheduling, **options)
    engine.runner.events = events
    return engine


def _run(engine: Engine, max_steps: int = 3000, between=None) -> dict:
    results: dict = {}
    for step in range(max_steps):
        if not engine.has_work():
            return results
        if between is not None:
            between(step, engine)
        for out in engine.step():
            results.setdefault((out.request_id, out.index), []).append(out)
    raise AssertionError("the engine did not finish within the step bound")


def _summary(results: dict) -> dict:
    """What a client sees of each sample: tokens, text, finish reason, logprobs."""
    return {
        key: (
            [t for out in outs for t in out.token_ids],
            "".join(out.text for out in outs),
            outs[-1].finish_reason,
            [out.logprobs for out in outs],
        )
        for key, outs in results.items()
    }


def _mixed_requests(engine: Engine) -> None:
    """Every kind of request: greedy, seeded sampling with top-k/p, logprobs, a stop string, EOS, n > 1
    (a stream group: the engine waits for its tokens), penalties and min_tokens (their history takes
    the unread token from the device; without it the chunked and preempting cases fail)."""
    prompts = [
        [1, 2, 3],
        [4, 5, 6, 7, 8, 9, 10, 11, 12],
        [13],
        [14, 15, 16, 17],
        [3, 3, 3, 3, 3, 3],
        [20, 21],
    ]
    kinds = [
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.9, top_k=8, top_p=0.9, seed=7, logprobs=3),
        SamplingParams(max_tokens=12, temperature=0, stop=("c",), ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.5, seed=3),  # EOS may end it
        SamplingParams(max_tokens=7, temperature=0.8, seed=11, n=3, logprobs=1),
        SamplingParams(max_tokens=8, temperature=0.7, seed=5, frequency_penalty=1.0, min_tokens=3),
        SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=2, ignore_eos=True),
    ]
    for i, params in enumerate(kinds):
        engine.add_request(f"r{i}", prompts[i % len(prompts)], params)


@pytest.mark.parametrize(
    "budget,num_blocks", [(64, 64), (5, 64), (64, 9)], ids=["roomy", "chunked", "preempting"]
)
def test_every_kind_of_request_gets_what_the_synchronous_engine_gives(budget, num_blocks):
    outputs = []
    for async_scheduling in (False, True):
        engine = _engine(async_scheduling, num_blocks=num_blocks, budget=budget, max_model_len=32)
        _mixed_requests(engine)
        outputs.append(_summary(_run(engine)))
        assert engine.scheduler.blocks.allocator.num_free == num_blocks
        assert (engine.scheduler.stats.preemptions > 0) == (num_blocks == 9)
        if async_scheduling and budget == 64 and num_blocks == 64:
            assert engine.runner.ahead > 0  # until the penalty and stream requests are done
    assert outputs[1] == outputs[0]


def test_a_request_aborted_while_its_next_step_runs_frees_everything_and_the_others_go_on():
    engines = {}
    for async_scheduling in (False, True):
        engine = engines[async_scheduling] = _engine(async_scheduling)
        engine.add_request("keep", [1, 2, 3], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
        engine.add_request("drop", [4, 5], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))

        def abort_at_step_3(step, engine):
            if step == 3:
                engine.abort("drop")

        results = _run(engine, between=abort_at_step_3)
        assert len(results[("drop", 0)]) == 3 and results[("drop", 0)][-1].finish_reason is None
        assert [t for out in results[("keep", 0)] for t in out.token_ids] == reference_greedy([1, 2, 3], 10)
        assert engine.scheduler.blocks.allocator.num_free == 64
    assert engines[True].runner.ahead > 0


def test_the_next_step_is_launched_before_the_previous_tokens_are_read(monkeypatch):
    """The overlap itself: execute(N+1) comes before step N's one read (`Draw.result`)."""
    events: list = []
    result = sampling.Draw.result

    def recorded(draw):
        events.append(("read",))
        return result(draw)

    monkeypatch.setattr(sampling.Draw, "result", recorded)
    engine = _engine(True, events=events)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    _run(engine)
    kinds = [event[0] for event in events]
    # prefill, then decodes 1..4 each launched before the previous step's read; the last read alone
    assert kinds == [
        "execute",
        "execute",
        "read",
        "execute",
        "read",
        "execute",
        "read",
        "execute",
        "read",
        "read",
    ]


def test_a_sequence_is_never_scheduled_past_its_last_token():
    """A pending token that is the last one max_tokens allows: no step runs ahead for it."""
    engine = _engine(True)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    _run(engine)
    steps = engine.runner.plans
    assert len(steps) == 3  # the prompt, then two decodes: the third token is never fed back
    assert [len(plan.chunks[0].token_ids) for plan in steps] == [3, 1, 1]


def test_a_plan_ahead_carries_its_unknown_tokens_as_pending():
    engine = _engine(True)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()  # the prompt runs, the first decode is launched ahead of its token
    ahead = engine._running.plan
    assert ahead.chunks[0].token_ids == (PENDING,) and ahead.chunks[0].start == 3


def test_an_engine_over_a_runner_that_cannot_run_ahead_refuses_async_scheduling():
    class Plain:
        def execute(self, plan):
            raise AssertionError("never called")

    with pytest.raises(ValueError, match="cannot run a step ahead"):
        Engine(
            Plain(),
            SchedulerConfig(num_blocks=8, max_model_len=64),
            LetterTokenizer(),
            {EOS},
            VOCAB,
            async_scheduling=True,
        )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from shiftlm.serve.engine.tokenizer import write_char_tokenizer
    from shiftlm.tools.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("async") / "tiny", "llama-gqa")
    write_char_tokenizer(path, vocab_size=256)
    return path


@pytest.mark.parametrize(
    "layout", [dict(), dict(sp=2), dict(tp=2, mode="tp")], ids=["1rank", "sp2-shift", "tp2"]
)
def test_the_model_runner_running_ahead_gives_the_synchronous_outputs(model_dir, layout):
    """The real model: rank 0's runner fills the pending tokens from its draws on the device and, over
    several ranks, broadcasts them to the others' devices."""
    from shiftlm import LLM

    prompts = ["hello there", "ab", "The capital of France is", "x"]
    params = [
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=4, max_tokens=7, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=9, max_tokens=11, presence_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
    ]
    results = {}
    with LLM(str(model_dir), num_blocks=32, block_size=4, async_scheduling=True, **layout) as llm:
        runner, execute = llm._runner, llm._runner.execute
        for async_scheduling in (False, True):  # one load: the engine's switch, between batches
            llm._engine.async_scheduling = async_scheduling
            ahead = []

            def counted(plan, pending=None, ahead=ahead):
                ahead.append(pending is not None)
                return execute(plan, pending) if pending is not None else execute(plan)

            runner.execute = counted
            outputs = llm.generate(prompts, params)
            results[async_scheduling] = [
                (s.token_ids, s.text, s.finish_reason, s.logprobs) for out in outputs for s in out.outputs
            ]
            assert sum(ahead) > 5 if async_scheduling else not any(ahead)
    assert results[True] == results[False]


def test_a_server_running_ahead_under_load_finishes_everything_and_gives_back_every_block(model_dir):
    """`shiftlm serve --async-scheduling` at sp 2 on a cache of 16 blocks (a plan ahead makes a sequence
    wait where a synchronous one would preempt): 60 concurrent greedy streams, a third of them dropped
    by their clients midway; the rest run to max_tokens and equal their text alone."""
    import asyncio

    import httpx

    from shiftlm.serve.local_server import local_server

    args = f"--model {model_dir} --sp 2 --shift-threshold 8 --num-blocks 16 --block-size 8 --async-scheduling --served-model-name tiny"

    def body(i: int, stream: bool) -> dict:
        return {
            "model": "tiny",
            "prompt": f"{i} {i}",
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }

    async def one(client: httpx.AsyncClient, i: int) -> str | None:
        text, finish = "", None
        async with client.stream("POST", "/v1/completions", json=body(i, True)) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    finish = choice["finish_reason"]
                    if i % 3 == 0 and len(text) >= 4:
                        return None  # the client goes away: its request is aborted mid-flight
        return text if finish == "length" else None

    async def main(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(60)))

    with local_server(args.split(), log_path=str(model_dir.parent / "async-server.log")) as live:
        texts = asyncio.run(main(live.url))
        alone = {
            i: httpx.post(f"{live.url}/v1/completions", json=body(i, False), timeout=120) for i in (1, 29, 59)
        }
        metrics = httpx.get(f"{live.url}/metrics", timeout=30).text
    assert all(texts[i] is not None for i in range(60) if i % 3)  # each ran to max_tokens
    assert {i: texts[i] for i in alone} == {i: r.json()["choices"][0]["text"] for i, r in alone.items()}
    values = {line.split()[0]: float(line.split()[-1]) for line in metrics.splitlines() if line[:1] != "#"}
    assert values["shiftlm_kv_cache_usage_ratio"] == 0.0  # every block came back
    assert values["shiftlm_num_requests_running"] == 0.0
