"""The simulator's per-rank memory (`sim.trainer_costs.trainer_memory`, what the preflight and the
planner use) against the trainer's measured allocation peak (`train.memory_probe`), within 10%
(issue 18, item 2) on an 8-layer model where states and activations are both large.
bench/memory_model.py runs every zero stage 0-3 at pp 1 and 2 (all within 3%); this test runs five
of them (dp2 x pp2 zero 1-3 are in the bench only, to keep the test short)."""

from __future__ import annotations

import json

import pytest

from shiftlm.config import ModelConfig
from shiftlm.train.memory_probe import allocation_peak, compare

RUN = [
    "--train.seq_len=256",
    "--train.micro_batch=2",
    "--train.global_batch=8",
    "--monitor.straggler_every=0",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    config = ModelConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=1024,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
    )
    directory = tmp_path_factory.mktemp("m8")
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict()))
    return str(directory)


@pytest.mark.parametrize(
    "world,layout",
    [
        (1, []),
        (2, ["--parallel.dp=2", "--train.zero=3"]),
        (4, ["--parallel.pp=2", "--parallel.dp=2", "--train.zero=0"]),
        (2, ["--parallel.dp=2", "--train.zero=1"]),
        (2, ["--parallel.dp=2", "--train.zero=2"]),
    ],
)
def test_the_memory_model_matches_the_measured_peak_within_10_percent(tmp_path, model_dir, world, layout):
    from shiftlm.launch import LocalWorkers

    overrides = [f"--model.name={model_dir}", *RUN, *layout]
    workers = LocalWorkers(world)  # fresh processes per layout, as bench/memory_model.py runs them
    try:
        result = compare(workers.run(allocation_peak, overrides, str(tmp_path)))
    finally:
        workers.close()
    assert abs(result["error"]) <= 0.10, result
