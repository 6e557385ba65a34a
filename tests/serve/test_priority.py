"""Priority scheduling (`--scheduling-policy priority`, a request's `priority`, vLLM's): the waiting
queue runs by (priority, arrival), the least urgent running sequence is preempted first, outputs do
not depend on the order, and a priority without the policy is refused."""

from __future__ import annotations

import pytest

from shiftlm.errors import ConfigError
from shiftlm.serve.engine.core import Engine
from shiftlm.serve.engine.errors import InvalidRequest
from shiftlm.serve.engine.scheduler import SchedulerConfig, ShiftPolicy
from shiftlm.serve.engine.sequence import SamplingParams
from tests.serve.fakes import EOS, VOCAB, LetterTokenizer, SlotRunner, reference_greedy


def _engine(policy: str, num_blocks: int = 64, max_num_seqs: int = 64, max_model_len: int = 32) -> Engine:
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=4,
        max_num_seqs=max_num_seqs,
        max_tokens_per_step=32,
        max_model_len=max_model_len,
        policy=ShiftPolicy(8),
        scheduling_policy=policy,
    )
    return Engine(SlotRunner(num_blocks, 4), config, LetterTokenizer(), {EOS}, VOCAB)


def _finish_order(engine: Engine) -> tuple[list[str], dict]:
    order, tokens = [], {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finish_reason is not None:
                order.append(out.request_id)
    return order, tokens


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_queue_runs_by_priority_then_arrival(policy):
    engine = _engine(policy, max_num_seqs=1)  # one at a time: the finish order is the queue's
    levels = {"a": 3, "b": 1, "c": 2, "d": 1}
    for name, level in levels.items():
        params = SamplingParams(
            max_tokens=4, temperature=0, ignore_eos=True, priority=level if policy == "priority" else 0
        )
        engine.add_request(name, [1, 2, 3], params)
    order, tokens = _finish_order(engine)
    assert order == (["b", "d", "c", "a"] if policy == "priority" else ["a", "b", "c", "d"])
    assert all(out == reference_greedy([1, 2, 3], 4) for out in tokens.values())


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_least_urgent_running_sequence_is_preempted(policy):
    """Two sequences that cannot both grow in 6 blocks: under fcfs the newer one gives way, under
    priority the one of lower priority (here the older), and both still get their greedy output."""
    engine = _engine(policy, num_blocks=6, max_model_len=20)
    engine.add_request(
        "old-low",
        [1, 2, 3, 4],
        SamplingParams(
            max_tokens=12, temperature=0, ignore_eos=True, priority=5 if policy == "priority" else 0
        ),
    )
    engine.step()  # admitted first
    engine.add_request(
        "new-high",
        [5, 6, 7, 8],
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    )
    seqs = {}
    while engine.has_work():
        for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
            seqs[seq.request_id] = seq
        engine.step()
    preempted = {name: seq.num_preemptions > 0 for name, seq in seqs.items()}
    assert preempted == (
        {"old-low": True, "new-high": False} if policy == "priority" else {"old-low": False, "new-high": True}
    )
    assert engine.scheduler.blocks.allocator.num_free == 6


def test_a_priority_without_the_policy_is_refused_and_the_policy_is_checked():
    engine = _engine("fcfs")
    with pytest.raises(InvalidRequest, match="--scheduling-policy priority") as err:
        engine.add_request("r", [1, 2], SamplingParams(priority=1))
    assert err.value.param == "priority"
    from shiftlm.serve.options import ServeOptions

    with pytest.raises(ConfigError, match="--scheduling-policy 'lifo' is not one of fcfs, priority"):
        ServeOptions(model="x", scheduling_policy="lifo")._check_flags()


def test_the_openai_field_reaches_the_sampling_params():
    from shiftlm.serve.http.protocol import CompletionRequest

    request = CompletionRequest(model="m", prompt="hi", priority=-3)
    assert request.unsupported_field() is None
    assert request.sampling_params(16, None, None).priority == -3


def test_the_offline_api_takes_one_priority_per_prompt(tmp_path):
    from shiftlm import LLM
    from shiftlm.serve.engine.tokenizer import write_char_tokenizer
    from shiftlm.tools.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "tiny", "llama-gqa")
    write_char_tokenizer(path, vocab_size=256)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    with LLM(str(path), scheduling_policy="priority", enforce_eager=True, max_num_seqs=1) as llm:
        alone = [llm.generate(p, greedy)[0].outputs[0].token_ids for p in ("ab", "cd", "ef")]
        ranked = llm.generate(["ab", "cd", "ef"], greedy, priority=[2, 0, 1])
        with pytest.raises(InvalidRequest, match="2 priorities for 3 prompts"):
            llm.generate(["ab", "cd", "ef"], greedy, priority=[0, 1])
    assert [out.outputs[0].token_ids for out in ranked] == alone  # in prompt order, each its own
    with pytest.raises(InvalidRequest, match="--scheduling-policy priority"):
        with LLM(str(path), enforce_eager=True) as llm:
            llm.generate(["ab"], greedy, priority=[1])
