"""The chunked LM head + cross-entropy (`train.loss_chunk`): the loss and gradients of the materialised
logits, on one rank and vocab-parallel under TP, without the whole batch's logits."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from shiftlm.comm import SINGLE
from shiftlm.config import ModelConfig
from shiftlm.model import build_model
from shiftlm.model.loss import IGNORE_INDEX, chunked_head_cross_entropy
from tests.train.test_compile import train_losses

HIDDEN, VOCAB, PADDED = 16, 37, 40


def _inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 7, HIDDEN, generator=generator, requires_grad=True)
    weight = torch.randn(PADDED, HIDDEN, generator=generator, requires_grad=True)
    targets = torch.randint(0, VOCAB, (2, 7), generator=generator)
    targets[0, 2] = targets[1, 6] = IGNORE_INDEX
    padding = torch.arange(PADDED) >= VOCAB
    return hidden, weight, targets, padding


def _materialised(hidden, weight, targets, padding):
    logits = (hidden @ weight.t()).masked_fill(padding, float("-inf"))
    return F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), reduction="none", ignore_index=IGNORE_INDEX
    ).view(targets.shape)


@pytest.mark.parametrize("rows", [1, 3, 14, 100])
def test_chunked_equals_materialised_loss_and_gradients(rows):
    hidden, weight, targets, padding = _inputs()
    scale = torch.rand(targets.shape, generator=torch.Generator().manual_seed(1))  # an upstream gradient
    want = _materialised(hidden, weight, targets, padding)
    want_grads = torch.autograd.grad((want * scale).sum(), [hidden, weight])
    got = chunked_head_cross_entropy(hidden, weight, targets, SINGLE, 0, padding, rows)
    got_grads = torch.autograd.grad((got * scale).sum(), [hidden, weight])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert bool((got[0, 2] == 0) & (got[1, 6] == 0))
    for ours, theirs in zip(got_grads, want_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_chunked_under_bf16_autocast_is_the_bf16_head():
    hidden, weight, targets, padding = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _materialised(hidden, weight, targets, padding)  # what the plain head does
        got = chunked_head_cross_entropy(hidden, weight, targets, SINGLE, 0, padding, 4)
    want_grads = torch.autograd.grad(want.sum(), [hidden, weight])
    got_grads = torch.autograd.grad(got.sum(), [hidden, weight])
    torch.testing.assert_close(got, want.float(), rtol=2e-2, atol=2e-2)
    for ours, theirs in zip(got_grads, want_grads):
        assert ours.dtype == theirs.dtype == torch.float32
        torch.testing.assert_close(ours, theirs, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("tied", [False, True])
def test_model_loss_chunked_equals_plain_head(tied):
    config = ModelConfig(vocab_size=250, num_layers=2, tie_word_embeddings=tied)  # 250: padded columns
    plain = build_model(config, seed=0)
    chunked = copy.deepcopy(plain)
    chunked.loss_chunk = 5
    ids = torch.randint(0, 250, (2, 9), generator=torch.Generator().manual_seed(0))
    targets = ids.roll(-1, dims=1)
    targets[:, -1] = IGNORE_INDEX
    want = plain.loss(plain(ids), targets)
    got = chunked.loss(chunked(ids), targets)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    want.sum().backward()
    got.sum().backward()
    for (name, ours), theirs in zip(chunked.named_parameters(), plain.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def materialised_losses(ranks, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("materialised"))
    return ranks.run(1, train_losses, ["--train.loss_chunk=0", "--train.compile=false"], path)[0]


LAYOUTS = {
    "one_rank": (1, []),
    "tp2": (2, ["--parallel.tp=2"]),
    "tp2_megatron_sp": (2, ["--parallel.tp=2", "--parallel.sequence_parallel=true"]),
    "zero3": (2, ["--parallel.dp=2", "--train.micro_batch=2", "--train.zero=3"]),
    "pp2_zb_v": (2, ["--parallel.pp=2", "--train.schedule=zb_v"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_training_with_chunks_matches_materialised_logits(ranks, tmp_path, materialised_losses, layout):
    world, overrides = LAYOUTS[layout]
    chunked = ["--train.loss_chunk=5", "--train.compile=false", *overrides]
    losses = ranks.run(world, train_losses, chunked, str(tmp_path))[0]
    for step, reference in materialised_losses.items():
        assert losses[step] == pytest.approx(reference, rel=1e-5), f"step {step}"
