from shiftlm.serve.engine.scheduler import Scheduler, SchedulerConfig, ShiftPolicy
from shiftlm.serve.engine.sequence import SamplingParams, Sequence
from shiftlm.serve.plan import Mode


def _scheduler(**overrides) -> Scheduler:
    config = dict(num_blocks=64, block_size=4, max_tokens_per_step=16, max_model_len=128)
    return Scheduler(SchedulerConfig(**{**config, **overrides}))


def _add(scheduler: Scheduler, length: int) -> Sequence:
    seq = Sequence("r", list(range(length)), SamplingParams())
    scheduler.add(seq)
    return seq


def _run_step(scheduler: Scheduler):
    plan = scheduler.schedule()
    for seq in scheduler.complete_step(plan):
        seq.output_ids.append(0)
    return plan


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget():
    scheduler = _scheduler()
    seq = _add(scheduler, 40)
    sizes = [_run_step(scheduler).num_tokens for _ in range(3)]
    assert sizes == [16, 16, 8] and seq.output_ids == [0]


def test_decodes_go_first_and_a_new_prefill_gets_the_rest_of_the_budget():
    scheduler = _scheduler()
    old = _add(scheduler, 5)
    _run_step(scheduler)
    new = _add(scheduler, 30)
    plan = _run_step(scheduler)
    assert [(c.seq_id, len(c.token_ids)) for c in plan.chunks] == [(old.seq_id, 1), (new.seq_id, 15)]


def test_when_blocks_run_out_the_newest_running_sequence_is_preempted_and_requeued():
    scheduler = _scheduler(num_blocks=4, max_model_len=16)
    old, new = _add(scheduler, 8), _add(scheduler, 4)
    _run_step(scheduler)  # old: 2 blocks, new: 1 block, one block kept free as headroom
    for _ in range(4):
        _run_step(scheduler)
    assert scheduler.stats.preemptions >= 1
    assert new in scheduler.waiting and new.num_computed == 0 and new.block_ids == []
    assert old in scheduler.running


def test_shift_policy_runs_full_tp_up_to_the_threshold_and_sp_tp_above():
    policy = ShiftPolicy(threshold=8)
    assert policy.mode_for(8) is Mode.TP and policy.mode_for(9) is Mode.SP_TP
    assert ShiftPolicy.named("tp").mode_for(10**9) is Mode.TP
    assert ShiftPolicy.named("sp_tp").mode_for(1) is Mode.SP_TP


def test_a_prefill_then_decodes_switches_mode_once():
    scheduler = _scheduler(policy=ShiftPolicy(threshold=4))
    _add(scheduler, 12)
    modes = [_run_step(scheduler).mode for _ in range(3)]
    assert modes == [Mode.SP_TP, Mode.TP, Mode.TP]
    assert scheduler.stats.mode_switches == 1


def test_max_model_len_must_fit_in_the_cache():
    try:
        SchedulerConfig(num_blocks=2, block_size=4, max_model_len=9)
    except ValueError as err:
        assert "max_model_len" in str(err)
    else:
        raise AssertionError("a context larger than the cache was accepted")
