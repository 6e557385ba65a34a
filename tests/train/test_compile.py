"""Compiled blocks (`train.compile`): one graph per block, the eager losses on every layout, and eager
with one warning line where inductor cannot build."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from shiftlm.config import ModelConfig
from shiftlm.errors import ConfigError
from shiftlm.model import build_model
from shiftlm.model.compile import CompiledBlock, compile_blocks, inductor_problem, wants_compile
from shiftlm.model.rope import rope_cos_sin
from shiftlm.train.config import load_config
from tests.train.conftest import run_training

STEPS = 5
BASE = [
    "--model.name=micro",
    "--train.seq_len=16",
    "--train.global_batch=4",
    "--train.micro_batch=1",
    f"--train.steps={STEPS}",
    "--optim.warmup_steps=2",
    "--checkpoint.resume=false",
    "--log.progress=off",
]


def train_losses(overrides: list[str], log_dir: str) -> dict[int, float]:
    return run_training(BASE, overrides, log_dir)


def _layer_inputs(model, batch: int = 2, seq: int = 8):
    x = torch.randn(batch, seq, model.config.hidden_size, requires_grad=True)
    positions = torch.arange(seq).expand(batch, -1)
    cos, sin = (t.unsqueeze(-2) for t in rope_cos_sin(model.inv_freq, positions, x.dtype))
    return x, cos, sin


def test_a_block_and_the_whole_model_trace_without_graph_breaks():
    config = ModelConfig(vocab_size=250, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4)
    model = build_model(config, seed=0)  # 250 rows: the head masks padding columns
    torch._dynamo.reset()
    block = torch._dynamo.explain(model.model.layers["0"].forward)(*_layer_inputs(model))
    whole = torch._dynamo.explain(model.forward)(torch.randint(0, 250, (2, 8)))
    assert (block.graph_count, block.graph_break_count) == (1, 0), block.break_reasons
    assert (whole.graph_count, whole.graph_break_count) == (1, 0), whole.break_reasons


def _block_graphs(parallel: dict) -> tuple[int, int, list[str]]:
    """On this rank: dynamo's graphs and breaks of a decoder layer's forward under `parallel`."""
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig

    mesh = Mesh(ParallelConfig(**parallel))
    config = ModelConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2
    )
    model = build_model(config, mesh, seed=0)
    seq = 8 // (mesh.tp.size if model.sequence_parallel else 1) // mesh.sp.size // mesh.cp.size
    torch._dynamo.reset()
    found = torch._dynamo.explain(model.model.layers["0"].forward)(*_layer_inputs(model, seq=seq))
    return found.graph_count, found.graph_break_count, [r.reason[:200] for r in found.break_reasons]


@pytest.mark.parametrize("parallel", [dict(tp=2), dict(sp=2), dict(cp=2)], ids=["tp2", "sp2", "cp2"])
def test_a_parallel_block_traces_as_one_graph(ranks, parallel):
    """TP's sums and gathers, Ulysses' all-to-alls and the cp ring are ops inside the block's graph
    (comm/ops.py, model/ring_attention.py), not breaks between graphs."""
    for graphs, breaks, reasons in ranks.run(2, _block_graphs, parallel):
        assert (graphs, breaks) == (1, 0), reasons


def test_every_layer_reuses_the_first_layers_graph(monkeypatch):
    """Compile time does not grow with depth: 6 layers, one dynamo graph. Counting graphs is
    dynamo's part, so they go to its `eager` backend (inductor's C++ build of the graph took 7.5 s
    of the suite on CI's cold cache; the tests below build it)."""
    from torch._dynamo.utils import counters

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn: compile_(fn, backend="eager"))
    config = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=6, num_heads=4)
    model = build_model(config, seed=0)
    torch._dynamo.reset()
    counters.clear()
    assert compile_blocks([model], torch.device("cpu"))
    model(torch.randint(0, 256, (2, 8))).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1


@pytest.fixture(scope="module")
def eager_losses(ranks, tmp_path_factory):
    return ranks.run(1, train_losses, ["--train.compile=false"], str(tmp_path_factory.mktemp("eager")))[0]


ONE_RANK = {
    "plain": [],
    "recompute_full": ["--train.recompute=full"],
    "recompute_selective": ["--train.recompute=selective"],
}


@pytest.mark.parametrize("name", list(ONE_RANK))
def test_compiled_one_rank_matches_eager(ranks, tmp_path, eager_losses, name):
    losses = ranks.run(1, train_losses, ["--train.compile=true", *ONE_RANK[name]], str(tmp_path))[0]
    assert list(losses) == list(range(1, STEPS + 1))
    for step, reference in eager_losses.items():
        assert losses[step] == pytest.approx(reference, rel=1e-5), f"step {step}"


LAYOUTS = {
    "tp2": ["--parallel.tp=2"],
    "sp2": ["--parallel.sp=2"],
    "pp2_1f1b": ["--parallel.pp=2", "--train.schedule=1f1b"],
    "pp2_zb_v": ["--parallel.pp=2", "--train.schedule=zb_v"],  # deferrable micro-batches run eagerly
    "zero3": ["--parallel.dp=2", "--train.micro_batch=2", "--train.zero=3"],
    "cp2": ["--parallel.cp=2"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_two_rank_layouts_match_eager_one_rank(ranks, tmp_path, eager_losses, layout):
    losses = ranks.run(2, train_losses, ["--train.compile=true", *LAYOUTS[layout]], str(tmp_path))
    assert losses[0] == losses[1]
    for step, reference in eager_losses.items():
        assert losses[0][step] == pytest.approx(reference, rel=1e-5), f"step {step}"


MOE = ["--model.name=micro-moe"]


@pytest.fixture(scope="module")
def eager_moe_losses(ranks, tmp_path_factory) -> dict[int, float]:
    return ranks.run(1, train_losses, [*MOE, "--train.compile=false"], str(tmp_path_factory.mktemp("moe")))[0]


@pytest.mark.parametrize("layout", [[], ["--parallel.dp=2", "--parallel.ep=2"]], ids=["one_rank", "dp2_ep2"])
def test_compiled_moe_blocks_with_the_aux_loss_match_eager(ranks, tmp_path, eager_moe_losses, layout):
    """A mixture of experts (micro-moe: the router, top-k dispatch, grouped expert GEMMs, the
    load-balancing loss in the training loss) in compiled blocks, on one rank and at ep2 x dp2: the
    losses of one eager rank (data-dependent routing sizes split a block into graphs; no fullgraph)."""
    compiled = ranks.run(
        1 + bool(layout), train_losses, [*MOE, "--train.compile=true", *layout], str(tmp_path / "c")
    )
    assert list(compiled[0]) == list(range(1, STEPS + 1))
    for step, reference in eager_moe_losses.items():
        assert compiled[0][step] == pytest.approx(reference, rel=1e-5), f"step {step}"


def test_compile_setting():
    assert wants_compile("auto", torch.device("cuda")) and not wants_compile("auto", torch.device("cpu"))
    assert wants_compile("true", torch.device("cpu")) and not wants_compile("false", torch.device("cuda"))
    with pytest.raises(ConfigError, match="train.compile = 'yes'; use one of auto, true, false"):
        load_config(None, ["--train.compile=yes"])


def test_toml_bool_is_accepted(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\ncompile = true\n")
    assert load_config(path).train.compile == "true"


def test_missing_compiler_warns_once_and_stays_eager(caplog):
    import torch._inductor.config as inductor_config

    # inductor's own patch context: monkeypatch's undo left `cpp.cxx` missing from torch's config, and
    # every later compile in the process failed with "torch._inductor.config.cpp.cxx does not exist"
    cpu = torch.device("cpu")
    model = build_model(ModelConfig(num_layers=2), seed=0)
    eager_forward = model.model.layers["0"].forward
    with inductor_config.patch({"cpp.cxx": (None, "/nonexistent/g++")}):
        assert "No working C++ compiler" in inductor_problem(cpu)
        with caplog.at_level(logging.WARNING, logger="shiftlm.model.compile"):
            assert not compile_blocks([model], cpu)
    assert len(caplog.records) == 1 and "running eagerly" in caplog.records[0].getMessage()
    assert model.model.layers["0"].forward == eager_forward
    assert CompiledBlock.broken is None


def test_missing_compiler_cli_prints_one_line_and_trains(tmp_path):
    """`shiftlm train --train.compile=true` with no working compiler: exit 0, one warning, no traceback."""
    env = {**os.environ, "CXX": "/nonexistent/g++", "PYTHONPATH": os.getcwd()}
    args = [f"--log.dir={tmp_path}", "--train.steps=2", "--train.compile=true", *BASE[:4], BASE[-1]]
    run = subprocess.run(
        [sys.executable, "-m", "shiftlm", "train", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    warnings = [line for line in run.stderr.splitlines() if "train.compile" in line]
    assert len(warnings) == 1 and "No working C++ compiler" in warnings[0], run.stderr


# pp 2 x 2 chunks x 8 micro-batches = 32 stage forwards; zb_v splits every one, dualpipe_v some
@pytest.mark.parametrize("schedule,split", [("zb_v", "32 of 32"), ("dualpipe_v", "5 of 32"), ("1f1b", None)])
def test_compiled_blocks_under_a_splitting_schedule_say_so_in_one_line(caplog, schedule, split):
    """Zero-bubble schedules' I + W micro-batches run eagerly under `train.compile`: one warning line
    names the schedule, how many stage forwards it splits, and the schedules that stay compiled."""
    from shiftlm.train.step import _warn_split_micro_batches

    batch = ["--train.micro_batch=1", "--train.global_batch=8"]
    config = load_config(None, ["--parallel.pp=2", f"--train.schedule={schedule}", *batch])
    with caplog.at_level(logging.WARNING, logger="shiftlm.train.step"):
        _warn_split_micro_batches(config)
    if split is None:
        assert caplog.records == []
        return
    (record,) = caplog.records
    message = record.getMessage()
    assert message.startswith(f"train.compile: {schedule} splits {split} stage forwards")
    assert "eagerly" in message and "1f1b or interleaved_1f1b" in message
