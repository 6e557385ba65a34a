"""Every layout the planners propose is one shiftlm runs (issue 10, item 3): the top plans of several
clusters pass the trainer's `load_config` and `check_layout`, and `plan serve` proposes one engine."""

from __future__ import annotations

import pytest

from shiftlm.hardware import CATALOG
from shiftlm.presets import PRESETS
from shiftlm.sim.capabilities import TRAINER_ZERO_STAGES, planned_zero_stages
from shiftlm.sim.efficiency import FITTED
from shiftlm.sim.planner import plan_training, train_config_toml
from shiftlm.sim.serve_plan import candidate_layouts
from shiftlm.sim.serve_runner import ServeHardware

CLUSTERS = [
    ("llama3-8b", "h100-sxm", 8, 4096, 16),
    ("llama3-70b", "h100-sxm", 64, 8192, 256),  # issue 10: the best plan here was zero = 3
    ("qwen2.5-7b", "a100-80gb", 16, 4096, 64),
    ("llama3-405b", "h200", 512, 8192, 512),
]


@pytest.mark.parametrize("name,gpu,gpus,seq,batch", CLUSTERS)
def test_top_plans_pass_the_trainers_config_and_layout_checks(name, gpu, gpus, seq, batch, tmp_path):
    from shiftlm.train.config import load_config
    from shiftlm.train.pipeline import build_schedule_for
    from shiftlm.train.setup import check_layout, model_config

    plan = plan_training(PRESETS[name], CATALOG[gpu], gpus, seq, batch, top_k=5, efficiency=FITTED)
    assert plan.ranked, f"no plan for {name} on {gpus} x {gpu}"
    for ranked in plan.ranked:
        path = tmp_path / "plan.toml"
        path.write_text(train_config_toml(name, ranked.layout))
        config = load_config(path)  # validates every key and value, ZeRO stage included
        model, _ = model_config(config.model.name, PRESETS[name].vocab_size, 0)
        parallel = check_layout(config, model, gpus)
        assert parallel.world_size == gpus and not parallel.sequence_parallel
        assert config.train.zero in TRAINER_ZERO_STAGES
        if config.parallel.pp > 1:
            build_schedule_for(config)  # the schedule exists for this many micro-batches
        # priced as the trainer runs it: no Megatron sequence parallelism
        assert not ranked.layout.sequence_parallel


def test_zero_stages_follow_the_trainer_table():
    assert planned_zero_stages(1) == (0,)
    assert TRAINER_ZERO_STAGES == (0, 1, 2, 3)  # the trainer implements ZeRO-2 and -3
    assert planned_zero_stages(8) == (2, 3)
    assert planned_zero_stages(8, (0, 1)) == (1,)
    assert planned_zero_stages(8, (0, 1, 2)) == (2,)  # ZeRO-2 dominates 1: same bytes, less memory
    assert planned_zero_stages(8, (0, 1, 2, 3)) == (2, 3)
    assert planned_zero_stages(8, (0, 1, 2, 3), pp=4) == (2,)  # ZeRO-3 re-gathers per micro-batch


def test_plan_serve_proposes_one_engine_only():
    setup = ServeHardware(PRESETS["llama-3.3-70b"], CATALOG["h100-sxm"], FITTED, "fp8", "bf16")
    layouts = candidate_layouts(setup, 8, (256,))
    assert layouts and all(layout.replicas == 1 and layout.gpus == 8 for layout in layouts)
