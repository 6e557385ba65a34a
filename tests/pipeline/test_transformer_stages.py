"""The pipelined Transformer composes with TP and Ulysses SP: loss and every gradient equal one rank.

4 ranks = pp 2 x (tp 2 or sp 2). Each rank builds its stages with `build_model` (layers from the
schedule's placement), the executor runs the schedule over the pp group while attention and the
parallel linears talk over tp/sp, then gradients are made whole as the trainer does: tied embedding
copies summed, `sync_tp_replicated_grads`, summed over dp_sp (`gather_full`). The model is the tiny
checkpoint's architecture with 4 layers (ZB-V needs 2 stage-chunks per rank) and the seeded init,
which is the same in every layout.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shiftlm.config import ModelConfig
from shiftlm.model.loss import IGNORE_INDEX
from shiftlm.parallel import ParallelConfig
from shiftlm.tools.parity import fixed_batch, relative_error
from shiftlm.tools.tiny import make_tiny_checkpoint

PP, LAYERS, MICROBATCHES, BATCH, SEQ_LEN, SEED = 2, 4, 4, 2, 8, 5


@pytest.fixture(scope="module")
def tiny_configs(tmp_path_factory) -> dict[str, ModelConfig]:
    """qwen2: tied embeddings and q/k/v biases; llama-gqa: untied head, 2 KV heads."""
    return {
        family: dataclasses.replace(
            ModelConfig.from_hf(make_tiny_checkpoint(tmp_path_factory.mktemp(family), family)),
            num_layers=LAYERS,
        )
        for family in ("qwen2", "llama-gqa")
    }


def _batches(config: ModelConfig) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    ids, targets = fixed_batch(config.vocab_size, BATCH * MICROBATCHES, SEQ_LEN)
    return list(ids.split(BATCH)), list(targets.split(BATCH)), int((targets != IGNORE_INDEX).sum())


def run_pipelined(config: ModelConfig, schedule_name: str, tp: int, sp: int, sequence_parallel: bool):
    """Per rank: one pipeline step; returns this rank's loss and, from (sp 0, tp 0), whole gradients
    before and after the tied-embedding sync."""
    from shiftlm.mesh import Mesh
    from shiftlm.model import build_model, stage_layers
    from shiftlm.model.grads import sync_tp_replicated_grads
    from shiftlm.model.weights import gather_full
    from shiftlm.pipeline.executor import PipelineExecutor
    from shiftlm.pipeline.schedules import build_schedule
    from shiftlm.pipeline.tied import sync_tied_embedding_grads

    mesh = Mesh(ParallelConfig(pp=PP, tp=tp, sp=sp, sequence_parallel=sequence_parallel))
    schedule = build_schedule(schedule_name, PP, MICROBATCHES)
    held = [stage for stage, _ in schedule.placement.stages_of(mesh.coords.pp)]
    stages = {
        s: build_model(config, mesh, seed=SEED, layers=stage_layers(LAYERS, schedule.num_stages, s))
        for s in held
    }
    ids, targets, num_targets = _batches(config)
    local = slice(mesh.sp.rank * SEQ_LEN // sp, (mesh.sp.rank + 1) * SEQ_LEN // sp)
    last = stages.get(schedule.num_stages - 1)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return last.loss(logits, target).sum() / num_targets

    executor = PipelineExecutor(
        schedule, stages, mesh.coords.pp, mesh.pp.pg, list(mesh.pp.ranks), loss_fn=loss_fn
    )
    loss = executor.step([x[:, local] for x in ids], [y[:, local] for y in targets])
    for stage in stages.values():
        sync_tp_replicated_grads(stage)
    before = {n: g for s in stages.values() for n, g in gather_full(s, grads=True).items()}
    sync_tied_embedding_grads(list(stages.values()), mesh)
    after = {n: g for s in stages.values() for n, g in gather_full(s, grads=True).items()}
    reports = mesh.coords.sp == 0 and mesh.coords.tp == 0
    return {
        "loss": None if loss is None or mesh.coords.tp else loss.item(),
        "before": before if reports else {},
        "after": after if reports else {},
    }


def _one_rank(config: ModelConfig) -> tuple[float, dict[str, torch.Tensor]]:
    from shiftlm.model import build_model

    model = build_model(config, seed=SEED)
    ids, targets, num_targets = _batches(config)
    total = 0.0
    for x, y in zip(ids, targets):
        loss = model.loss(model(x), y).sum() / num_targets
        loss.backward()
        total += loss.item()
    grads = {name: p.grad for name, p in model.named_parameters()}
    if config.tie_word_embeddings:  # the last stage's copy must carry the whole tied gradient too
        grads["lm_head.weight"] = grads["model.embed_tokens.weight"]
    return total, grads


LAYOUTS = {"tp2": (2, 1, False), "tp2_sequence_parallel": (2, 1, True), "sp2": (1, 2, False)}
CASES = [
    ("qwen2", schedule, layout) for schedule in ("1f1b", "zb_v", "zb_h1") for layout in ("tp2", "sp2")
] + [("llama-gqa", "zb_v", "tp2_sequence_parallel"), ("llama-gqa", "1f1b", "sp2")]


@pytest.mark.parametrize("family,schedule,layout", CASES)
def test_pipelined_transformer_matches_one_rank(ranks, tiny_configs, family, schedule, layout):
    config = tiny_configs[family]
    results = ranks.run(4, run_pipelined, config, schedule, *LAYOUTS[layout])
    want_loss, want_grads = _one_rank(config)
    assert sum(r["loss"] for r in results if r["loss"] is not None) == pytest.approx(want_loss, rel=1e-5)
    got = {name: grad for r in results for name, grad in r["after"].items()}
    assert got.keys() == want_grads.keys()
    for name, grad in got.items():
        assert relative_error(grad, want_grads[name])[1] <= 1e-5, name


@pytest.mark.parametrize("schedule", ["1f1b", "zb_v"])  # copies on two ranks, and on one
def test_tied_embedding_copies_need_the_sync_and_get_the_sum(ranks, tiny_configs, schedule):
    config = tiny_configs["qwen2"]
    results = ranks.run(4, run_pipelined, config, schedule, *LAYOUTS["tp2"])
    _, want = _one_rank(config)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        before = next(r["before"][name] for r in results if name in r["before"])
        after = next(r["after"][name] for r in results if name in r["after"])
        assert relative_error(before, want[name])[1] > 1e-2  # each copy alone misses the other's part
        assert relative_error(after, want[name])[1] <= 1e-5
