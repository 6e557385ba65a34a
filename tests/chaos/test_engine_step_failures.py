"""An exception inside an engine step fails only that step's requests (500) and the engine goes on;
a runner exception with several ranks (they may now disagree on the next collective) stops the engine
and calls the server's fatal hook (issue 13.1/13.2). In-process: an AsyncEngine over the fake runner."""

from __future__ import annotations

import asyncio

import pytest

from shiftlm.serve.engine.async_engine import AsyncEngine
from shiftlm.serve.engine.core import Engine
from shiftlm.serve.engine.errors import EngineDead, StepFailed
from shiftlm.serve.engine.scheduler import SchedulerConfig, ShiftPolicy
from shiftlm.serve.engine.sequence import SamplingParams
from tests.serve.fakes import EOS, VOCAB, LetterTokenizer, SlotRunner

POISON = 13  # a prompt holding this token makes the fake runner raise


class PoisonRunner(SlotRunner):
    def execute(self, plan):
        if any(POISON in chunk.token_ids for chunk in plan.chunks):
            raise RuntimeError("boom: poisoned step")
        return super().execute(plan)


def _async_engine(multi_rank: bool, fatal: list) -> AsyncEngine:
    config = SchedulerConfig(num_blocks=32, block_size=4, max_model_len=64, policy=ShiftPolicy(8))
    engine = Engine(PoisonRunner(32, 4), config, LetterTokenizer(), eos_token_ids={EOS}, vocab_size=VOCAB)
    return AsyncEngine(engine, multi_rank=multi_rank, on_fatal=fatal.append)


async def _collect(engine: AsyncEngine, prompt: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    return [t for out in [o async for o in engine.generate(prompt, params)] for t in out.token_ids]


def test_a_failing_step_fails_its_request_with_500_and_the_engine_goes_on():
    fatal: list = []
    engine = _async_engine(multi_rank=False, fatal=fatal)

    async def main():
        with pytest.raises(StepFailed, match="boom"):
            await _collect(engine, [1, POISON, 2])
        return await asyncio.wait_for(_collect(engine, [1, 2, 3]), timeout=30)

    try:
        assert len(asyncio.run(main())) == 5
        assert engine.error is None and engine.failed_steps == 1 and not fatal
        assert engine.engine.scheduler.blocks.allocator.num_free == 32  # the failed request freed its blocks
    finally:
        engine.shutdown()


def test_a_runner_failure_across_ranks_stops_the_engine_and_calls_the_fatal_hook():
    fatal: list = []
    engine = _async_engine(multi_rank=True, fatal=fatal)

    async def main():
        with pytest.raises(EngineDead, match="model runner failed"):
            await asyncio.wait_for(_collect(engine, [POISON]), timeout=30)

    asyncio.run(main())
    assert engine.error is not None and len(fatal) == 1
    with pytest.raises(EngineDead):
        engine.submit([[1]], SamplingParams())


def test_a_row_whose_sampling_raises_fails_its_request_alone(monkeypatch):
    """Issue 35.1: a failure while sampling one row failed every request of the step. The sampler is
    made to raise for rows of one request (seed 666); the greedy neighbours finish with the tokens
    they get alone, and only the poisoned request gets StepFailed."""
    from shiftlm.serve.engine import core as engine_module

    def poison(real):
        def poisoned(logits, rows, eos_ids=frozenset()):
            if any(row.params.seed == 666 for row in rows):
                raise OverflowError("planted: this row cannot be sampled")
            return real(logits, rows, eos_ids)

        return poisoned

    fatal: list = []
    engine = _async_engine(multi_rank=False, fatal=fatal)
    alone = asyncio.run(_collect(engine, [1, 2, 3]))
    for name in ("draw_rows", "sample_rows"):  # the step's one draw, then its row-by-row retry
        monkeypatch.setattr(engine_module, name, poison(getattr(engine_module, name)))

    async def main():
        bad = SamplingParams(max_tokens=5, temperature=1.0, seed=666)
        good = [asyncio.ensure_future(_collect(engine, [1, 2, 3])) for _ in range(3)]
        with pytest.raises(StepFailed, match="planted"):
            async for _ in engine.generate([4, 5], bad):
                pass
        return await asyncio.wait_for(asyncio.gather(*good), timeout=30)

    try:
        assert asyncio.run(main()) == [alone] * 3
        assert engine.error is None and engine.failed_requests == 1 and not fatal
        assert engine.engine.scheduler.blocks.allocator.num_free == 32
    finally:
        engine.shutdown()
