"""Training a mixture of experts: every layout with expert parallelism (ep x dp, ep x tp x pp, ZeRO-3
with the experts sharded over their own `edp` group) gives one rank's losses, load-balancing loss
included, over 5 steps and its step-1 gradients (fp32, 1e-5); one rank's loss is transformers'."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from shiftlm.comm import all_reduce
from shiftlm.model.sharding import shard_spec
from shiftlm.model.weights import take_shard
from shiftlm.train.config import load_config
from shiftlm.train.trainer import Trainer
from tests.train.conftest import moe_qwen2_config

STEPS = 5
TOLERANCE = 1e-5
BASE = [
    "--train.seq_len=32",
    "--train.global_batch=4",
    "--train.micro_batch=1",
    f"--train.steps={STEPS}",
    "--optim.warmup_steps=2",
    "--optim.grad_clip=0.5",  # below the norms (~1): every step is clipped, so the norm must be right
    "--log.progress=off",
]


def _full_local_grads(trainer: Trainer) -> torch.Tensor:
    """This rank's flat gradients after the step's sums; at ZeRO-2/3 rebuilt from the shards, each
    unit over its own group (`edp` for experts, `dp_sp` else)."""
    optimizer, flat = trainer.optimizer, trainer.flat
    if not trainer.sharded_grads:
        return flat.grads.clone()
    full = flat.zeros()
    pieces = zip(flat.units, optimizer.ranges, trainer.grad_sync.offsets, optimizer.unit_groups)
    for (offset, length), (a, b), start, group in pieces:
        full[a:b] = optimizer.grad_shard[start : start + b - a]
        full[offset : offset + length] = all_reduce(full[offset : offset + length], group)
    return full


def losses_and_first_grads(overrides: list[str], log_dir: str) -> tuple[dict, dict, tuple[int, int]]:
    """The run's losses and gradient norms by step, this rank's step-1 gradients by HF name (its
    experts and TP shards, summed over their data groups, before clipping), and (tp rank, tp size)."""
    config = load_config(
        None, [*BASE, f"--log.dir={log_dir}", "--checkpoint.resume=false", "--checkpoint.every=0", *overrides]
    )
    trainer = Trainer(config, quiet=True)
    grads: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def capture(lr: float, grad_scale: float = 1.0) -> None:
        if not grads:
            grads.update(
                {n: t.clone() for n, t in trainer.flat.unflatten(_full_local_grads(trainer)).items()}
            )
        step(lr, grad_scale)

    norms: dict[int, float] = {}
    optimizer_step = trainer.step

    def record_norm(index: int, micro_batches: list) -> tuple[float, float, float]:
        loss, norms[index + 1], lr = optimizer_step(index, micro_batches)
        return loss, norms[index + 1], lr

    trainer.optimizer.step, trainer.step = capture, record_norm
    losses = trainer.run().losses
    if dist.is_initialized():
        dist.barrier()
    return (losses, norms), grads, (trainer.mesh.tp.rank, trainer.mesh.tp.size)


@pytest.fixture(scope="module")
def one_rank(ranks, moe_model, tmp_path_factory):
    return ranks.run(1, losses_and_first_grads, [moe_model], str(tmp_path_factory.mktemp("one")))[0]


LAYOUTS = {  # world size, overrides; ep is folded over dp (x cp x sp): dp4 ep2 is ep2 x edp2
    "ep2_x_dp2": (4, ["--parallel.dp=4", "--parallel.ep=2"]),
    "ep2_x_tp2_x_pp2": (
        8,
        ["--parallel.dp=2", "--parallel.ep=2", "--parallel.tp=2", "--parallel.pp=2", "--train.schedule=1f1b"],
    ),
    "ep2_zero3": (4, ["--parallel.dp=4", "--parallel.ep=2", "--train.zero=3"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ep_layout_losses_and_first_gradients_equal_one_rank(ranks, tmp_path, moe_model, one_rank, layout):
    world, overrides = LAYOUTS[layout]
    runs = ranks.run(world, losses_and_first_grads, [moe_model, *overrides], str(tmp_path))
    (one_losses, one_norms), one_grads, _ = one_rank
    assert one_losses[STEPS] < one_losses[1]  # it learns
    assert min(one_norms.values()) > 0.5  # clipped
    for rank, ((losses, norms), _, _) in enumerate(runs):
        assert list(losses) == list(range(1, STEPS + 1))
        for step, reference in one_losses.items():
            assert losses[step] == pytest.approx(reference, rel=TOLERANCE), f"rank {rank} step {step}"
            assert norms[step] == pytest.approx(one_norms[step], rel=TOLERANCE), (
                f"norm: rank {rank} step {step}"
            )
    config, seen = moe_qwen2_config(), set()
    for rank, (_, grads, (tp_rank, tp_size)) in enumerate(runs):
        for name, grad in grads.items():
            expected = take_shard(one_grads[name], shard_spec(name, config, tp_rank, tp_size))
            error = ((grad - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item()
            assert error <= TOLERANCE, f"rank {rank} {name}: relative error {error:.2e}"
            seen.add(name)
    assert seen == set(one_grads)  # every parameter, each expert on some rank
    for _, grads, _ in runs:  # each rank holds 4 / ep = 2 experts of each of its MoE layers
        experts: dict[str, set[str]] = {}
        for name in (n for n in grads if ".experts." in n):
            layer, rest = name.split(".experts.")
            experts.setdefault(layer, set()).add(rest.split(".")[0])
        assert experts and all(len(held) == 2 for held in experts.values())


def test_the_load_balancing_loss_is_in_the_training_loss(ranks, tmp_path, moe_model, one_rank):
    """Without it (output_router_logits false) the step-1 loss drops by ~coef x top-k (balanced
    routing's aux loss is about top-k), and the routers' gradients change."""
    directory = tmp_path / "no_aux"
    directory.mkdir()
    (directory / "config.json").write_text(
        json.dumps(moe_qwen2_config(output_router_logits=False).to_hf_dict())
    )
    (losses, _), grads, _ = ranks.run(
        1, losses_and_first_grads, [f"--model.name={directory}"], str(tmp_path)
    )[0]
    aux = one_rank[0][0][1] - losses[1]
    assert 0.5 * 0.1 * 2 < aux < 2 * 0.1 * 2
    router = "model.layers.1.mlp.gate.weight"
    assert not torch.allclose(grads[router], one_rank[1][router])


def step_one_losses(model_dir: str, log_dir: str) -> tuple[float, float]:
    """(shiftlm's step-1 loss on one rank, transformers' on the same micro-batches and weights:
    the mean over micro-batches of cross-entropy + router_aux_loss_coef x its `aux_loss`)."""
    from transformers import AutoModelForCausalLM

    config = load_config(None, [*BASE, f"--model.name={model_dir}", f"--log.dir={log_dir}"])
    trainer = Trainer(config, quiet=True)
    micro_batches = trainer.reader.step(0)
    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="eager"
    )
    expected = 0.0
    with torch.no_grad():
        for inputs, targets in micro_batches:
            out = hf(torch.as_tensor(inputs), output_router_logits=True)
            ce = torch.nn.functional.cross_entropy(
                out.logits.flatten(0, 1), torch.as_tensor(targets).flatten()
            )
            expected += (ce + hf.config.router_aux_loss_coef * out.aux_loss).item() / len(micro_batches)
    return trainer.step(0, micro_batches)[0], expected


def test_one_rank_loss_is_transformers_loss_with_its_aux_term(ranks, tmp_path):
    import transformers as tf

    config = tf.Qwen2MoeConfig(
        vocab_size=2048,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        mlp_only_layers=[0],
        norm_topk_prob=False,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
    )
    torch.manual_seed(0)
    model = tf.Qwen2MoeForCausalLM(config).float()
    with torch.no_grad():  # routers far from uniform, so the loss is not just top-k
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours, expected = ranks.run(1, step_one_losses, str(tmp_path / "hf"), str(tmp_path / "run"))[0]
    assert ours == pytest.approx(expected, rel=TOLERANCE)


def test_dry_run_checks_an_ep_x_pp_layout_against_one_rank(capsys, tmp_path, moe_model):
    """`shiftlm train --dry-run`: the stand-in keeps the MoE (2 experts per ep rank, the aux loss) and
    its step at ep2 x pp2 x ZeRO-2 equals one rank's."""
    from shiftlm.cli import main

    layout = ["--parallel.dp=2", "--parallel.ep=2", "--parallel.pp=2", "--train.zero=2"]
    assert main(["train", "--dry-run", moe_model, *layout, f"--log.dir={tmp_path}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "ep2" in lines[0] and "equal to one rank" in lines[-1], lines
