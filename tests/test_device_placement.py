"""Every tensor the engine creates is created on the mesh's device (issue 12's placement proof on CPU).

Each check runs with `torch.set_default_device("meta")` while the engine's device is the CPU: a tensor
created without `device=` (or outside the model's `torch.device(mesh.device)` scope) lands on meta,
and the first op mixing it with the engine's CPU tensors fails. On a GPU the same line would put a CPU
tensor in front of a CUDA kernel or an NCCL collective. The last test removes one `device=` and shows
that the guard catches it.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.train.test_streams_training import samples  # noqa: F401 - the multi-stream data fixture

SHORT = ["--train.steps=2", "--optim.warmup_steps=1"]  # after test_layouts' BASE: the later value wins


@contextlib.contextmanager
def allocations_default_to_meta():
    """Any factory call without a device inside this block makes a meta tensor (no data)."""
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def train_under_guard(overrides: list[str], log_dir: str, guarded: bool = True) -> dict[int, float]:
    """Build the model, train two steps (gradient sync, optimizer, checkpoint) on this rank."""
    from tests.train.test_layouts import train_losses

    with allocations_default_to_meta() if guarded else contextlib.nullcontext():
        return train_losses([*SHORT, *overrides], log_dir)


@pytest.fixture(scope="module")
def one_rank_losses(ranks, tmp_path_factory):
    return ranks.run(1, train_under_guard, [], str(tmp_path_factory.mktemp("one")), False)[0]


# tp x sp x pp x dp (and cp, ZeRO-3, a V schedule) on four ranks
LAYOUTS = {
    "tp2_dp2_zero3": ["--parallel.tp=2", "--parallel.dp=2", "--train.zero=3"],
    "pp2_sp2": ["--parallel.pp=2", "--parallel.sp=2"],
    "pp2_tp2_zb_v": ["--parallel.pp=2", "--parallel.tp=2", "--train.schedule=zb_v"],
    "cp2_sp2": ["--parallel.cp=2", "--parallel.sp=2"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_device_placement_training_step_allocates_nothing_off_the_mesh_device(
    ranks, tmp_path, one_rank_losses, layout
):
    losses = ranks.run(4, train_under_guard, LAYOUTS[layout], str(tmp_path))
    assert all(rank_losses == losses[0] for rank_losses in losses)
    for step, expected in one_rank_losses.items():  # and the guarded run computes the same numbers
        assert losses[0][step] == pytest.approx(expected, rel=1e-5), f"step {step}"


def stream_train_under_guard(overrides: list[str], log_dir: str, guarded: bool = True) -> dict[int, float]:
    """Training on multi-stream samples (stream masks and positions built per micro-batch)."""
    from tests.train.test_streams_training import train_losses

    with allocations_default_to_meta() if guarded else contextlib.nullcontext():
        return train_losses(overrides, log_dir)


def test_device_placement_multi_stream_training_allocates_nothing_off_the_mesh_device(
    ranks,
    tmp_path,
    samples,  # noqa: F811 - the fixture imported above
):
    from tests.train.test_streams_training import base

    one = ranks.run(1, stream_train_under_guard, base(samples), str(tmp_path / "one"), False)[0]
    layout = ["--parallel.pp=2", "--parallel.tp=2", "--train.steps=2"]
    losses = ranks.run(4, stream_train_under_guard, base(samples) + layout, str(tmp_path / "four"))[0]
    for step, expected in losses.items():
        assert expected == pytest.approx(one[step], rel=1e-5), f"step {step}"


def serve_under_guard(model_dir: str, tp: int, sp: int, guarded: bool = True) -> list | None:
    """Load the checkpoint, run a prefill and a decode step in both modes, sample on rank 0."""
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.engine.sampling import SampleRow, make_generator, sample_rows
    from shiftlm.serve.engine.sequence import SamplingParams
    from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan
    from shiftlm.serve.worker.runner import ModelRunner

    mesh = Mesh(ParallelConfig(tp=tp, sp=sp), device="cpu")
    out = []
    with allocations_default_to_meta() if guarded else contextlib.nullcontext():
        runner = ModelRunner.load(model_dir, mesh, num_blocks=8, block_size=4)
        for index, mode in enumerate(Mode):
            row, block = index, 4 * index
            prefill = ScheduledChunk(0, (5, 17, 33, 2, 9), 0, (block, block + 1), True, False, 0, row)
            decode = ScheduledChunk(0, (7,), 5, (), True, False, 1, row)
            for step, chunk in enumerate((prefill, decode)):
                logits = runner.run_step(StepPlan(2 * index + step, mode, (chunk,)))
                if logits is None:
                    continue
                params = [  # greedy, seeded filtering + penalties, logit bias + min_tokens + logprobs
                    SamplingParams(temperature=0.0),
                    SamplingParams(temperature=0.8, top_k=5, top_p=0.9, repetition_penalty=1.2, seed=3),
                    SamplingParams(
                        presence_penalty=0.5, logit_bias=((3, 2.0),), min_tokens=4, logprobs=2, seed=4
                    ),
                ]
                rows = [SampleRow(0, p, make_generator(p, 0), (5, 17), (9,)) for p in params]
                result = sample_rows(logits, rows, eos_ids={1})
                out.append((logits[0, : runner.model_config.vocab_size].clone(), result.tokens))
    return out if mesh.rank == 0 else None


def test_device_placement_serving_step_allocates_nothing_off_the_mesh_device(ranks, tmp_path):
    from shiftlm.tools.tiny import make_tiny_checkpoint

    model_dir = str(make_tiny_checkpoint(tmp_path / "llama-gqa", "llama-gqa"))
    guarded = ranks.run(4, serve_under_guard, model_dir, 2, 2)[0]
    plain = ranks.run(4, serve_under_guard, model_dir, 2, 2, False)[0]
    assert len(guarded) == 4  # prefill + decode in each mode
    for (logits, tokens), (expected_logits, expected_tokens) in zip(guarded, plain):
        assert torch.equal(logits, expected_logits) and tokens == expected_tokens


def engine_under_guard(model_dir: str, guarded: bool = True) -> dict | None:
    """The whole engine loop on 4 ranks: plans broadcast to the workers, logits gathered, a request
    next to a hogwild stream group, in shift mode (full TP and SP x TP steps)."""
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.engine.core import Engine
    from shiftlm.serve.engine.scheduler import SchedulerConfig, ShiftPolicy
    from shiftlm.serve.engine.sequence import SamplingParams
    from shiftlm.serve.worker.runner import ModelRunner
    from tests.serve.fakes import LetterTokenizer

    mesh = Mesh(ParallelConfig(tp=2, sp=2), device="cpu")
    with allocations_default_to_meta() if guarded else contextlib.nullcontext():
        runner = ModelRunner.load(model_dir, mesh, num_blocks=32, block_size=4)
        if mesh.rank != 0:
            runner.serve_steps()
            return None
        policy = ShiftPolicy.named("shift", threshold=4)
        config = SchedulerConfig(
            num_blocks=32, block_size=4, max_tokens_per_step=8, max_model_len=64, policy=policy
        )
        vocab = runner.model_config.vocab_size
        engine = Engine(runner, config, LetterTokenizer(), eos_token_ids=set(), vocab_size=vocab)
        greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        engine.add_request("r", [5, 17, 33, 2, 9, 100, 7], greedy)
        engine.add_streams("g", [240, 1, 77, 8, 8], [[3, 4], [6]], [greedy, greedy], "hogwild")
        outputs: dict = {}
        while engine.has_work():
            for out in engine.step():
                outputs.setdefault((out.request_id, out.index), []).extend(out.token_ids)
        runner.stop_workers()
    return outputs


def test_device_placement_engine_loop_allocates_nothing_off_the_mesh_device(ranks, tmp_path):
    from shiftlm.tools.tiny import make_tiny_checkpoint

    model_dir = str(make_tiny_checkpoint(tmp_path / "llama-gqa", "llama-gqa"))
    guarded = ranks.run(4, engine_under_guard, model_dir)[0]
    assert sorted(guarded) == [("g", 0), ("g", 1), ("r", 0)]
    assert all(len(tokens) == 4 for tokens in guarded.values())
    assert guarded == ranks.run(4, engine_under_guard, model_dir, False)[0]


class _TorchWithoutDevice:
    """The torch module as one engine file sees it, except that `zeros` forgets its `device=`."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, **kwargs)


def train_with_one_device_dropped(log_dir: str) -> str:
    """The flat gradient/parameter buffers (train/flat.py) allocated without their device."""
    from shiftlm.train import flat

    flat.torch = _TorchWithoutDevice()
    try:
        train_under_guard([], log_dir)
    except Exception as err:  # noqa: BLE001 - the failure is the result
        return f"{type(err).__name__}: {err}"
    finally:
        flat.torch = torch
    return "trained"


def test_device_placement_guard_fails_when_one_allocation_forgets_its_device(ranks, tmp_path):
    outcome = ranks.run(1, train_with_one_device_dropped, str(tmp_path))[0]
    # a meta tensor met the CPU parameters: "variable and tensor have incompatible tensor type"
    assert outcome.startswith("RuntimeError") and "incompatible tensor type" in outcome, outcome
