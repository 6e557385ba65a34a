"""ZeRO-2 and ZeRO-3 train the same model as ZeRO-0 and one rank, with TP / SP / PP composed; their
checkpoints resume under any stage; ZeRO-2/3 hold 1/dp of the gradients plus a unit in transit, and
ZeRO-3 1/dp of the parameters plus the layers in use (measured with the allocator)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist

from shiftlm.config import ModelConfig
from shiftlm.train.config import load_config
from shiftlm.train.trainer import Trainer
from shiftlm.train.zero3 import unit_labels
from tests.train.conftest import tied_qwen2_config

STEPS = 3
BASE = [
    "--model.name=micro",
    "--train.seq_len=32",
    "--train.global_batch=4",
    "--train.micro_batch=1",
    f"--train.steps={STEPS}",
    "--optim.warmup_steps=2",
    "--log.progress=off",
]


def _trainer(overrides: list[str], log_dir: str) -> Trainer:
    return Trainer(load_config(None, [*BASE, f"--log.dir={log_dir}", *overrides]), quiet=True)


def losses_and_first_grads(
    overrides: list[str], log_dir: str
) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """The run's losses, and the summed gradient of every parameter at step 1 (before clipping),
    assembled from the owned ranges at ZeRO >= 2 (where each rank holds only its ranges' sums)."""
    trainer = _trainer([*overrides, "--checkpoint.resume=false", "--checkpoint.every=0"], log_dir)
    grads: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def capture(lr: float, grad_scale: float = 1.0) -> None:
        if not grads:
            optimizer, flat = trainer.optimizer, trainer.flat
            if trainer.sharded_grads:  # each rank holds only its shard: no full-size gradient buffer
                assert flat.grads is None
                shard = optimizer.grad_shard
                assert shard.numel() * optimizer.group.size == flat.padded
                full = flat.zeros()
                for (a, b), start in zip(optimizer.ranges, trainer.grad_sync.offsets):
                    full[a:b] = shard[start : start + b - a]
                dist.all_reduce(full, group=optimizer.group.pg)
            else:
                full = flat.grads.clone()
            grads.update({name: t.clone() for name, t in flat.unflatten(full).items()})
        step(lr, grad_scale)

    trainer.optimizer.step = capture
    losses = trainer.run().losses
    if dist.is_initialized():
        dist.barrier()
    return losses, grads


@pytest.fixture(scope="module")
def single_rank_losses(ranks, tmp_path_factory):
    return ranks.run(1, losses_and_first_grads, [], str(tmp_path_factory.mktemp("one")))[0][0]


LAYOUTS = {  # world size, overrides
    "dp2": (2, ["--parallel.dp=2"]),
    "sp2": (2, ["--parallel.sp=2"]),  # Ulysses peers hold the same weights: sharded over dp_sp
    "dp2_tp2": (4, ["--parallel.dp=2", "--parallel.tp=2"]),
    "dp2_pp2_zb_v": (4, ["--parallel.dp=2", "--parallel.pp=2", "--train.schedule=zb_v"]),
    "dp2_pp2_1f1b_recompute": (
        4,
        ["--parallel.dp=2", "--parallel.pp=2", "--train.schedule=1f1b", "--train.recompute=full"],
    ),
}


def _check_zero_runs(runs: dict, one_rank_losses: dict) -> None:
    """Every rank's step-1 gradients at zero 2 and 3 equal zero 0's, and rank 0's losses one rank's."""
    for zero in (2, 3):
        for rank, ((_, grads), (_, reference)) in enumerate(zip(runs[zero], runs[0])):
            assert grads.keys() == reference.keys()
            for name, grad in grads.items():
                error = (
                    (grad - reference[name]).abs().max() / reference[name].abs().max().clamp_min(1e-12)
                ).item()
                assert error <= 1e-5, f"zero={zero} rank {rank} {name}: relative error {error:.2e}"
        for step, reference in one_rank_losses.items():
            assert runs[zero][0][0][step] == pytest.approx(reference, rel=1e-5), f"zero={zero} step {step}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_zero_2_and_3_losses_and_gradients_equal_zero_0_and_one_rank(
    ranks, tmp_path, single_rank_losses, layout
):
    world, overrides = LAYOUTS[layout]
    runs = {
        zero: ranks.run(
            world, losses_and_first_grads, [*overrides, f"--train.zero={zero}"], str(tmp_path / str(zero))
        )
        for zero in (0, 2, 3)
    }
    _check_zero_runs(runs, single_rank_losses)


@pytest.fixture(scope="module")
def tied_single_kv_model(tmp_path_factory) -> str:
    """A qwen2-style micro model (q/k/v biases, LM head tied to the embedding) with one KV head, so
    tp2 replicates the KV rows: both sums DP does not see are taken on the gradient shards."""
    return tied_qwen2_config(tmp_path_factory.mktemp("tied_one_kv"), num_kv_heads=1)


TIED_LAYOUTS = {  # world size, overrides
    "dp2_tp2_megatron_sp": (4, ["--parallel.dp=2", "--parallel.tp=2", "--parallel.sequence_parallel=true"]),
    "dp2_pp2_1f1b": (4, ["--parallel.dp=2", "--parallel.pp=2", "--train.schedule=1f1b"]),
    "dp2_pp2_bitpipe": (4, ["--parallel.dp=2", "--parallel.pp=2", "--train.schedule=bitpipe"]),
}


@pytest.mark.parametrize("layout", list(TIED_LAYOUTS))
def test_zero_2_and_3_take_the_tied_and_tp_replicated_sums_on_the_shards(
    ranks, tmp_path, tied_single_kv_model, layout
):
    world, overrides = TIED_LAYOUTS[layout]
    one = ranks.run(1, losses_and_first_grads, [tied_single_kv_model], str(tmp_path / "one"))[0][0]
    runs = {
        zero: ranks.run(
            world,
            losses_and_first_grads,
            [tied_single_kv_model, *overrides, f"--train.zero={zero}"],
            str(tmp_path / str(zero)),
        )
        for zero in (0, 2, 3)
    }
    _check_zero_runs(runs, one)


def losses_with_checkpoints(overrides: list[str], log_dir: str, resume: bool) -> dict[int, float]:
    trainer = _trainer(
        [*overrides, f"--checkpoint.resume={str(resume).lower()}", "--checkpoint.every=2"], log_dir
    )
    trainer.maybe_resume()
    losses = trainer.run().losses
    if dist.is_initialized():
        dist.barrier()
    return losses


@pytest.mark.parametrize("saved,resumed", [(3, 0), (0, 3), (3, 2), (1, 3)])
def test_a_checkpoint_resumes_bit_exactly_under_another_zero_stage(ranks, tmp_path, saved, resumed):
    layout = ["--parallel.dp=2", "--optim.grad_clip=0"]
    full = ranks.run(
        2, losses_with_checkpoints, [*layout, f"--train.zero={saved}"], str(tmp_path / "a"), False
    )[0]
    # the run that resumes: the step-2 checkpoint of the first run, continued under another stage
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for later in (tmp_path / "b" / "checkpoints").glob("step_*"):
        if later.name != "step_00000002":
            shutil.rmtree(later)
    resumed_losses = ranks.run(
        2, losses_with_checkpoints, [*layout, f"--train.zero={resumed}"], str(tmp_path / "b"), True
    )[0]
    assert sorted(resumed_losses) == [3]
    assert resumed_losses[3] == full[3]  # bit for bit


@pytest.fixture(scope="module")
def eight_layer_model(tmp_path_factory) -> str:
    """Layers dominate the parameters (as in a real LLM), so per-layer gathering shows."""
    config = ModelConfig(
        vocab_size=2048,  # the embedded tokenizer's
        hidden_size=128,
        intermediate_size=512,
        num_layers=8,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        model_type="llama",
    )
    directory = tmp_path_factory.mktemp("eight")
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict()))
    return f"--model.name={directory}"


def parameter_memory(overrides: list[str], log_dir: str) -> dict[str, int]:
    trainer = _trainer(
        [*overrides, "--checkpoint.resume=false", "--checkpoint.every=0", "--train.steps=2"], log_dir
    )
    trainer.run()
    shards = trainer.optimizer.shards
    units = [length * 4 for _, length in trainer.flat.units]
    result = {"full": trainer.flat.numel * 4, "largest_unit": max(units), "units": len(units)}
    if shards is not None:
        result["peak"] = shards.peak_bytes
        result["at_rest"] = sum(t.numel() * 4 for t in shards.master)
    if dist.is_initialized():
        dist.barrier()
    return result


def test_zero_3_peak_parameter_memory_is_a_dp_share_plus_a_layer_in_use_and_one_prefetched(
    ranks, tmp_path, eight_layer_model
):
    memory = ranks.run(
        2, parameter_memory, [eight_layer_model, "--parallel.dp=2", "--train.zero=3"], str(tmp_path)
    )
    for rank in memory:
        share = rank["full"] / 2
        assert rank["at_rest"] == pytest.approx(share, rel=0.01)  # padding only
        # the measured peak: the shard, the unit in use and the next one being gathered (FSDP's prefetch)
        assert share < rank["peak"] <= share + 2 * rank["largest_unit"]
        assert rank["peak"] < 0.8 * rank["full"]  # vs zero=0, which holds all of `full` throughout


def allocator_memory(overrides: list[str], log_dir: str) -> dict:
    """The allocator's view (torch.profiler memory events) of gradient and parameter storage during
    2 training steps (the build is profiled too, so what it allocated counts as live; the peak is
    taken from the first step on), next to the sizes they should have."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from shiftlm.train.flat import GRADS_TAG, PARAMS_TAG
    from shiftlm.train.memory_probe import profiled_events, tagged_peak

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer = _trainer(
            [*overrides, "--checkpoint.resume=false", "--checkpoint.every=0", "--train.steps=3"], log_dir
        )
        with record_function("test.run"):
            trainer.run(stop_after=2)
    events = profiled_events(prof)
    flat, optimizer = trainer.flat, trainer.optimizer
    shard = sum(b - a for a, b in optimizer.ranges)
    # what one module gathers at once: a layer, the embedding, or the final norm + LM head (two units)
    labels = unit_labels([slot.name for slot in flat.slots])
    modules: dict[str, int] = {}
    for index, (_, length) in enumerate(flat.units):
        label = labels[flat.unit_of.index(index)].replace("lm_head", "head")
        modules[label] = modules.get(label, 0) + length * 4
    result = {
        "grads": tagged_peak(events, GRADS_TAG, after="test.run"),
        "params": tagged_peak(events, PARAMS_TAG, after="test.run"),
        "full": flat.padded * 4,
        "shard": shard * 4,
        "units": sorted(length * 4 for _, length in flat.units),
        "largest_module": max(modules.values()),
        "masks": [optimizer.decay_mask.numel(), trainer.norm_mask.numel()],
        "shard_elements": shard,
    }
    if dist.is_initialized():
        dist.barrier()
    return result


@pytest.mark.parametrize(
    "layout",
    [
        (2, ["--parallel.dp=2"]),
        (4, ["--parallel.dp=2", "--parallel.pp=2", "--train.schedule=1f1b"]),
        (4, ["--parallel.dp=2", "--parallel.pp=2", "--train.schedule=zb_v"]),
    ],
    ids=["dp2", "dp2_pp2_1f1b", "dp2_pp2_zb_v"],
)
def test_gradients_and_parameters_are_sharded_as_the_allocator_sees_them(
    ranks, tmp_path, eight_layer_model, layout
):
    world, overrides = layout
    runs = {
        zero: ranks.run(
            world,
            allocator_memory,
            [eight_layer_model, *overrides, f"--train.zero={zero}"],
            str(tmp_path / str(zero)),
        )
        for zero in (0, 1, 2, 3)
    }
    for rank in range(world):
        full = runs[0][rank]["full"]
        # zero 0 and 1: one full-size gradient buffer and the full parameters, throughout
        for zero in (0, 1):
            assert runs[zero][rank]["grads"] == full
            assert runs[zero][rank]["params"] == full
        for zero in (2, 3):
            run = runs[zero][rank]
            largest, second = run["units"][-1], run["units"][-2]
            # the masks are shard-sized (no full-size fp32 mask beside the shard)
            assert run["masks"] == [run["shard_elements"]] * 2
            # 1/dp of the gradients, plus at most one unit filling while the previous one is reduced
            assert run["shard"] == pytest.approx(full / 2, rel=0.01)
            assert run["shard"] < run["grads"] <= run["shard"] + largest + second, (zero, rank, run)
            if world == 2:  # 8 layers on the rank: the two units in transit are small beside the rest
                assert run["grads"] < 0.8 * full
        # zero 3: 1/dp of the parameters at rest plus the module in use and the unit prefetched
        run = runs[3][rank]
        bound = run["shard"] + run["largest_module"] + run["units"][-1]
        assert run["shard"] < run["params"] <= bound, (rank, run)
        assert runs[2][rank]["params"] == full
