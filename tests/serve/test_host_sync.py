"""A decode step makes no host sync between its first and last layer (issue 34): nothing in the layers
reads a tensor's value back to Python (`.item()`, `bool(tensor)`, `.tolist()`) or runs an op whose
output shape depends on the data (`nonzero`, `masked_select`, ...), which on a GPU would stop the host
until the device catches up and rule out CUDA graphs. Recorded with a dispatch mode around the layers."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan
from shiftlm.tools.tiny import make_tiny_checkpoint

# aten ops that read device memory on the host, or size their output by the data
SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive",
           "unique_dim", "repeat_interleave", "bincount", "histc", "equal"}  # fmt: skip


class SyncRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.inside, self.found = False, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if (
            self.inside
            and name in SYNCING
            and not (name == "repeat_interleave" and (kwargs or {}).get("output_size"))
        ):
            self.found.append(name)
        return func(*args, **(kwargs or {}))


def _decode_plans():
    prefill = ScheduledChunk(0, (5, 17, 33, 2, 9, 100, 7), 0, (0, 1), True, row=0)
    other = ScheduledChunk(1, (44, 3, 8), 0, (2,), True, row=1)
    decode = (
        ScheduledChunk(0, (11,), 7, (), True, row=0),
        ScheduledChunk(1, (12,), 3, (3,), True, row=1),
    )
    return StepPlan(0, Mode.TP, (prefill, other)), StepPlan(1, Mode.TP, decode)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "planted"])
def test_a_decode_step_reads_nothing_back_inside_the_layers(tmp_path, monkeypatch, backend):
    """`planted`: a layer that calls `.item()` is caught (the check can fail)."""
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    model_dir = make_tiny_checkpoint(tmp_path / "m", "llama-gqa")
    attention = "auto" if backend == "planted" else backend
    runner = ModelRunner.load(
        model_dir, Mesh(ParallelConfig()), num_blocks=16, block_size=4, attention_backend=attention
    )
    layers = list(runner.shift_model.model.model.layers.values())
    if backend == "planted":
        layers[0].mlp.register_forward_hook(lambda _m, _i, out: out.sum().item())
    recorder = SyncRecorder()
    first, last = layers[0], layers[-1]
    first.register_forward_pre_hook(lambda *_: setattr(recorder, "inside", True))
    last.register_forward_hook(lambda *_: setattr(recorder, "inside", False))
    tolist = torch.Tensor.tolist

    def recorded_tolist(tensor):
        if recorder.inside:
            recorder.found.append("tolist")
        return tolist(tensor)

    monkeypatch.setattr(torch.Tensor, "tolist", recorded_tolist)
    prefill, decode = _decode_plans()
    runner.run_step(prefill)
    with recorder:
        logits = runner.run_step(decode)
    assert logits.shape[0] == 2
    assert recorder.inside is False  # the hooks ran: the layers were inside the recording
    assert recorder.found == (["_local_scalar_dense"] if backend == "planted" else [])
