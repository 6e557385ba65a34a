"""On a GPU, CUDA's own sync detector (`torch.cuda.set_sync_debug_mode`) checks what the CPU tests of
test_host_sync.py check by recording ops (issue 34): a decode step's model forward (eager, compiled,
and replayed from CUDA graphs) waits for the device nowhere, and drawing a step's tokens, every
sampling parameter mixed, waits for it once (the read of the tokens). `cuda`-marked: skipped without a
GPU, run by `python bench/gpu.py --phase cuda_tests` on a lent one."""

from __future__ import annotations

import warnings

import pytest
import torch

from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan
from shiftlm.tools.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.cuda


class _SyncsAreErrors:
    """Inside: any operation that waits for the device raises (CUDA's sync debug mode)."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *_):
        torch.cuda.set_sync_debug_mode("default")


def _plans() -> list[StepPlan]:
    prefill = (
        ScheduledChunk(0, (5, 17, 33, 2, 9, 100, 7), 0, (0, 1), True, row=0),
        ScheduledChunk(1, (44, 3, 8), 0, (2,), True, row=1),
    )
    out, lengths = [StepPlan(0, Mode.TP, prefill)], [7, 3]
    for step in range(1, 4):
        decode = tuple(
            ScheduledChunk(i, (11 + step,), lengths[i], (3,) if i == 1 and step == 2 else (), True, row=i)
            for i in range(2)
        )
        out.append(StepPlan(step, Mode.TP, decode))
        lengths = [n + 1 for n in lengths]
    return out


@pytest.mark.parametrize("path", ["eager", "compiled", "graphs", "planted"])
def test_a_decode_step_forward_never_waits_for_the_gpu(tmp_path, path):
    """`planted`: a forward that calls `.item()` raises (the check can fail)."""
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    model_dir = make_tiny_checkpoint(tmp_path / "m", "llama-gqa")
    runner = ModelRunner.load(
        model_dir,
        Mesh(ParallelConfig(), device="cuda"),
        num_blocks=16,
        block_size=4,
        compile_decode=path in ("compiled", "graphs"),
        max_num_seqs=4,
        max_model_len=32,
    )
    shift = runner.shift_model
    if path == "compiled":
        shift.graphs = None  # the compiled step itself, not its graphs
    assert (shift.graphs is not None) == (path == "graphs")
    forward = shift.forward
    if path == "planted":
        original = forward

        def forward(batch, mode, rows):
            out = original(batch, mode, rows)
            out.sum().item()
            return out

    watched_steps = []

    def watched(batch, mode, rows):
        watched_steps.append(mode)
        with _SyncsAreErrors():
            return forward(batch, mode, rows)

    plans = _plans()
    runner.execute(plans[0])  # the prefill, unwatched
    shift.forward = watched
    if path == "planted":
        with pytest.raises(RuntimeError, match="synchroniz"):
            runner.execute(plans[1])
        return
    for plan in plans[1:]:
        logits = runner.execute(plan)
        assert logits.shape[0] == 2 and torch.isfinite(logits.float()).all()
    assert len(watched_steps) == 3
    if path == "graphs":
        assert shift.graphs.steps == 3  # every decode replayed a graph
    if path == "compiled":
        assert shift.compiled.steps == 3  # every decode ran the compiled step (graphs were off)


def test_drawing_a_step_waits_for_the_gpu_once(monkeypatch):
    """Every parameter the API accepts, mixed in one step: drawing makes no synchronising call (CUDA's
    sync detector, "warn", counts them), and reading the draws (`Draw.result`) waits once, on the
    event of the one device-to-host copy (an event wait is not among what the detector reports)."""
    from shiftlm.serve.engine.sampling import draw_rows

    from .test_host_sync import mixed_step

    logits, rows = mixed_step(torch.device("cuda"))
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            draw = draw_rows(logits, rows, eos_ids={0})
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert syncs == [], syncs
    waits = []
    wait = torch.cuda.Event.synchronize
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda event: waits.append(event) or wait(event))
    result = draw.result()
    assert waits == [draw.copied] and draw.table.device.type == "cpu" and draw.table.is_pinned()
    assert result.tokens[0] == int(logits[0].argmax()) and result.tokens[6] == int(logits[6].argmax())
    assert result.logprobs[1] is not None and len(result.logprobs[1].top) == 3
