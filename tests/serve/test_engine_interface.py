"""The engine's interface to the HTTP layer: `AsyncEngine.submit` validates a request once, queues
nothing unless every prompt passes, counts refusals itself; `stats()` is what /metrics reads."""

from __future__ import annotations

import asyncio

import pytest

from shiftlm.serve.engine.async_engine import AsyncEngine
from shiftlm.serve.engine.core import Engine
from shiftlm.serve.engine.errors import InvalidRequest, Overloaded
from shiftlm.serve.engine.metrics import render_engine_metrics
from shiftlm.serve.engine.scheduler import SchedulerConfig
from shiftlm.serve.engine.sequence import SamplingParams
from shiftlm.serve.http.protocol import api_error
from tests.serve.fakes import EOS, VOCAB, LetterTokenizer, SlotRunner


class CountingEngine(Engine):
    checks = 0

    def check_request(self, prompt_ids, params):
        self.checks += 1
        super().check_request(prompt_ids, params)


def _engine(max_pending: int = 512) -> AsyncEngine:
    config = SchedulerConfig(num_blocks=32, block_size=4, max_model_len=64)
    engine = CountingEngine(
        SlotRunner(32, 4), config, LetterTokenizer(), eos_token_ids={EOS}, vocab_size=VOCAB
    )
    return AsyncEngine(engine, max_pending=max_pending)


def test_a_request_of_three_prompts_is_validated_three_times_and_not_again_on_the_engine_thread():
    engine = _engine()
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def main():
        streams = engine.submit([[1, 2], [3], [4, 5, 6]], params)
        outputs = []
        for stream in streams:
            outputs.append([out async for out in stream])
        return outputs

    outputs = asyncio.run(main())
    engine.shutdown()
    assert [len(o[-1].token_ids) for o in outputs] == [1, 1, 1] and engine.engine.checks == 3
    assert engine.stats().prompt_tokens == 6 and engine.stats().generation_tokens == 9


def test_one_bad_prompt_refuses_the_whole_request_with_nothing_queued():
    engine = _engine()
    with pytest.raises(InvalidRequest, match="prompt token ids"):
        engine.submit([[1, 2], [VOCAB + 1]], SamplingParams())
    with pytest.raises(InvalidRequest, match="logit_bias token"):
        engine.submit([[1]], SamplingParams(logit_bias=((VOCAB, 1.0),)))
    engine.shutdown()
    assert engine.num_pending == 0 and engine.stats().waiting == 0


def test_a_refusal_for_capacity_is_counted_and_what_can_never_fit_is_a_400():
    """--max-pending counts a request when `submit` admits it (issue 35.6), not when its outputs are
    first read; a 429 says when to retry; more prompts than the limit can never be admitted."""
    engine = _engine(max_pending=1)

    async def main():
        first = engine.submit([[1]], SamplingParams(max_tokens=50, ignore_eos=True))
        assert engine.num_pending == 1  # counted before anything was read
        with pytest.raises(Overloaded) as refused:
            engine.submit([[2]], SamplingParams())
        answer = api_error(refused.value)  # the front's one table of engine errors
        assert answer.status == 429 and answer.retry_after == 1.0
        with pytest.raises(InvalidRequest, match="--max-pending"):
            engine.submit([[1], [2]], SamplingParams())
        assert len([out async for out in first[0]]) == 50

    asyncio.run(main())
    engine.shutdown()
    assert "shiftlm_rejected_requests_total 1" in render_engine_metrics(engine)
    assert "shiftlm_kv_cache_usage_ratio 0.0" in render_engine_metrics(engine)


def test_an_admitted_request_nobody_reads_is_released_and_aborted():
    engine = _engine(max_pending=1)

    async def main():
        engine.submit([[1]], SamplingParams(max_tokens=50, ignore_eos=True))  # dropped unread
        assert engine.num_pending == 0
        second = engine.submit([[2]], SamplingParams(max_tokens=2, ignore_eos=True))
        return [out async for out in second[0]]

    assert len(asyncio.run(main())) == 2
    engine.shutdown()


def test_health_is_503_while_a_step_runs_past_half_the_step_timeout():
    """Issue 35.2: a step that holds the engine shows on /health (503, Retry-After) well before the
    server gives up at --step-timeout."""
    from starlette.testclient import TestClient

    from shiftlm.serve.http.app import ApiOptions, build_app

    engine = _engine()
    running = {"seconds": 0.0}
    engine.step_running_for = lambda: running["seconds"]
    client = TestClient(build_app(engine, LetterTokenizer(), ApiOptions("m", step_timeout=60.0)))
    try:
        assert client.get("/health").status_code == 200
        running["seconds"] = 31.0
        stale = client.get("/health")
        assert stale.status_code == 503 and stale.headers["retry-after"] == "1"
        assert "half of --step-timeout 60 s" in stale.json()["error"]["message"]
    finally:
        engine.shutdown()
