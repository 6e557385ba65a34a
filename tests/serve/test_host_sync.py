"""A decode step makes no host sync between its first and last layer (issue 34): nothing in the layers
reads a tensor's value back to Python (`.item()`, `bool(tensor)`, `.tolist()`) or runs an op whose
output shape depends on the data (`nonzero`, `masked_select`, ...), which on a GPU would stop the host
until the device catches up and rule out CUDA graphs. Recorded with a dispatch mode around the layers."""

from __future__ import annotations

from dataclasses import replace

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
        if (
            self.inside
            and name in ("index", "index_put", "index_put_", "_index_put_impl_")
            and _bool_index(args)
        ):
            self.found.append(f"{name} by a boolean mask")  # sized by the mask's count: a read on a GPU
        return func(*args, **(kwargs or {}))


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in indices)


def _decode_plans():
    prefill = ScheduledChunk(0, (5, 17, 33, 2, 9, 100, 7), 0, (0, 1), True, row=0)
    other = ScheduledChunk(1, (44, 3, 8), 0, (2,), True, row=1)
    decode = (
        ScheduledChunk(0, (11,), 7, (), True, row=0),
        ScheduledChunk(1, (12,), 3, (3,), True, row=1),
    )
    return StepPlan(0, Mode.TP, (prefill, other)), StepPlan(1, Mode.TP, decode)


@pytest.mark.parametrize(
    "backend, family",
    [
        ("auto", "llama-gqa"),
        ("sdpa", "llama-gqa"),
        ("planted", "llama-gqa"),
        ("auto", "mixtral"),
        ("auto", "qwen2-moe"),
    ],
)
def test_a_decode_step_reads_nothing_back_inside_the_layers(tmp_path, monkeypatch, backend, family):
    """`planted`: a layer that calls `.item()` is caught (the check can fail). Mixtures of experts too:
    routing, the rows per expert (a fixed-size scatter-add, not `bincount`) and the grouped GEMMs."""
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    model_dir = make_tiny_checkpoint(tmp_path / "m", family)
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


def test_a_step_of_unequal_prefill_chunks_reads_nothing_back_inside_the_layers(tmp_path):
    """Chunks of 7 and 3 tokens (the shorter padded) through gather + SDPA: their padded query rows
    were dropped with a boolean index, which on a GPU waits for it (nonzero), twice a layer; now by
    indices made on the host with the plan."""
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker.runner import ModelRunner

    model_dir = make_tiny_checkpoint(tmp_path / "m", "llama-gqa")
    runner = ModelRunner.load(
        model_dir, Mesh(ParallelConfig()), num_blocks=16, block_size=4, attention_backend="sdpa"
    )
    layers = list(runner.shift_model.model.model.layers.values())
    recorder = SyncRecorder()
    layers[0].register_forward_pre_hook(lambda *_: setattr(recorder, "inside", True))
    layers[-1].register_forward_hook(lambda *_: setattr(recorder, "inside", False))
    prefill, _ = _decode_plans()
    with recorder:
        logits = runner.run_step(prefill)
    assert logits.shape[0] == 2 and recorder.inside is False
    assert recorder.found == []


def _tensors(value, path="batch"):
    """Every tensor inside a (nested) dataclass, with its path."""
    import dataclasses

    if isinstance(value, torch.Tensor):
        yield path, value
    elif dataclasses.is_dataclass(value):
        for field in dataclasses.fields(value):
            yield from _tensors(getattr(value, field.name), f"{path}.{field.name}")
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{path}[{index}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{path}[{key!r}]")


def test_the_plan_is_decoded_on_the_host_and_every_tensor_moves_to_the_device():
    """The runner decodes a plan where its sizes cost no device sync (the host), then `FlatBatch.to`
    moves the batch: every tensor of it, the attention groups' and a stream group's rotation too (a
    field added later without a move fails here)."""
    from shiftlm.model.stream_mask import HOGWILD
    from shiftlm.serve.worker.plan_codec import BlockTables, decode_plan, encode_plan
    from tests.model.test_stream_mask import POSITIONS, STREAMS

    tables = BlockTables(8)
    prefill, decode = _decode_plans()
    batches = [decode_plan(encode_plan(plan), tables, 4)[2] for plan in (prefill, decode)]
    streams = dict(layout=HOGWILD, prompt_len=2, streams=tuple(STREAMS), positions=tuple(POSITIONS))
    group = ScheduledChunk(0, (7, 8, 9, 10, 11), 0, (3, 1, 4), True, sample_rows=2, **streams)
    stream_plan = StepPlan(0, Mode.TP, (group,))
    batches.append(decode_plan(encode_plan(stream_plan), BlockTables(8), 2, inv_freq=torch.ones(2))[2])
    assert batches[-1].chunks[0].rotation is not None
    for batch in batches:
        host = list(_tensors(batch))
        assert host and all(t.device.type == "cpu" for _, t in host)
        moved = list(_tensors(batch.to(torch.device("meta"))))
        assert [path for path, _ in moved] == [path for path, _ in host if not path.endswith("_folded")]
        assert [path for path, t in moved if t.device.type != "meta"] == []


def mixed_step(device: torch.device):
    """(logits [7, 50], rows) of a step mixing every parameter the API accepts: greedy, temperature,
    top-k/p, penalties, logit bias, min_tokens, logprobs, seeds, a row with no finite logit (row 6)."""
    from shiftlm.serve.engine.sampling import SampleRow, make_generator
    from shiftlm.serve.engine.sequence import SamplingParams

    torch.manual_seed(0)
    logits = torch.randn(7, 50, device=device)
    logits[6] = float("-inf")  # no finite probability: keeps its argmax
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_k=5, logprobs=3),
        SamplingParams(temperature=1.0, top_p=0.9, seed=7),
        SamplingParams(temperature=1.2, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
        SamplingParams(temperature=0.7, logit_bias=((3, 5.0), (9, -100.0)), min_tokens=4, logprobs=0),
        SamplingParams(temperature=1.0, seed=3, top_k=10, top_p=0.5),
        SamplingParams(temperature=1.0),
    ]
    rows = [
        SampleRow(i, p, make_generator(p, 0), prompt_ids=(1, 2, 3), output_ids=(4, 4))
        for i, p in enumerate(params)
    ]
    rows[3] = replace(rows[3], pending=torch.tensor([7], device=device))  # a token the step ahead drew
    return logits, rows


def test_sampling_a_step_reads_the_device_once(monkeypatch):
    """A step mixing every parameter the API accepts (greedy, temperature, top-k/p, penalties, logit
    bias, min_tokens, logprobs, seeds, a row with no finite logit) reads back to the host once: the
    tokens and logprobs together. Without a GPU the reads are counted: `.tolist()` calls and the ops
    that read a value or size by data (`SyncRecorder`)."""
    from shiftlm.serve.engine.sampling import sample_rows

    logits, rows = mixed_step(torch.device("cpu"))
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: (reads.append("tolist"), tolist(t))[1])
    recorder = SyncRecorder()
    recorder.inside = True
    with recorder:
        result = sample_rows(logits, rows, eos_ids={0})
    assert reads == ["tolist"] and recorder.found == []
    assert len(result.tokens) == 7 and result.tokens[0] == int(logits[0].argmax())
    assert result.tokens[6] == int(logits[6].argmax())
    assert result.logprobs[1] is not None and len(result.logprobs[1].top) == 3
    assert result.logprobs[4] is not None and result.logprobs[4].top == ()
    assert result.logprobs[0] is None


def test_sampling_copies_to_the_device_without_waiting_for_it(monkeypatch):
    """A host-to-device copy that is not `non_blocking` waits for the whole stream (the model's step
    included): the sampler builds every small tensor on the host and copies it asynchronously
    (`sampling._on`), so with asynchronous scheduling the host is free while the next step runs.
    Checked without a GPU on the `meta` device, standing for one: no `torch.tensor(..., device=<it>)`
    and no blocking `.to(<it>)` while a step mixing every parameter is drawn."""
    from shiftlm.serve.engine import sampling
    from shiftlm.serve.engine.sampling import SampleRow, draw_rows, make_generator
    from shiftlm.serve.engine.sequence import SamplingParams

    device = torch.device("meta")
    params = [
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, logprobs=2),
        SamplingParams(temperature=1.0, seed=3, repetition_penalty=1.2, presence_penalty=0.5),
        SamplingParams(temperature=0.5, logit_bias=((3, 2.0),), min_tokens=5, frequency_penalty=0.3),
    ]
    pending = torch.tensor([4], device=device)
    rows = [SampleRow(i, p, make_generator(p, 0), (1, 2), (3,), pending) for i, p in enumerate(params)]
    logits = torch.randn(3, 40, device=device)
    blocking = []
    for name in ("tensor", "as_tensor"):
        made = getattr(torch, name)

        def spy(*args, made=made, name=name, **kwargs):
            if kwargs.get("device") is not None and torch.device(kwargs["device"]) == device:
                blocking.append(f"torch.{name}(device=meta)")
            return made(*args, **kwargs)

        monkeypatch.setattr(torch, name, spy)
    to = torch.Tensor.to

    def spy_to(tensor, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        moving = isinstance(target, (str, torch.device)) and torch.device(target) != tensor.device
        if moving and not kwargs.get("non_blocking", False):
            blocking.append(".to(device) blocking")
        return to(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    draw = draw_rows(logits, rows, eos_ids={0})
    assert blocking == [], blocking
    assert draw.tokens.shape == (3,) and draw.tokens.device == device
    monkeypatch.setattr(
        sampling, "_on", lambda device, values, dtype: torch.tensor(values, dtype=dtype, device=device)
    )
    draw_rows(logits, rows, eos_ids={0})  # the planted synchronous copies are seen
    assert blocking and all(b == "torch.tensor(device=meta)" for b in blocking)


def _two_rank_step_syncs(model_dir: str) -> list[str]:
    """On this rank (sp2): the syncing ops recorded inside the forward and the logits gather of decode
    steps in both modes (one greedy row that travels as its argmax, one sampled row sent whole)."""
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.worker import runner as runner_module
    from shiftlm.serve.worker.runner import ModelRunner

    runner = ModelRunner.load(model_dir, Mesh(ParallelConfig(sp=2)), num_blocks=16, block_size=4)
    recorder = SyncRecorder()

    def recorded(fn):
        def call(*args, **kwargs):
            recorder.inside = True
            try:
                return fn(*args, **kwargs)
            finally:
                recorder.inside = False

        return call

    runner.shift_model.forward = recorded(runner.shift_model.forward)
    gather = runner_module.gather_logits
    runner_module.gather_logits = recorded(gather)
    tolist = torch.Tensor.tolist
    torch.Tensor.tolist = lambda tensor: (
        (recorder.found.append("tolist") if recorder.inside else None) or tolist(tensor)
    )
    try:
        prefill, decode = _decode_plans()
        runner.run_step(prefill)
        greedy = replace(decode.chunks[0], argmax_only=True)
        with recorder:
            for mode in Mode:
                runner.run_step(replace(decode, mode=mode, chunks=(greedy, decode.chunks[1])))
    finally:
        runner_module.gather_logits, torch.Tensor.tolist = gather, tolist
    return recorder.found


def test_a_two_rank_step_reads_nothing_back_in_the_forward_or_the_logits_gather(ranks, tmp_path):
    """Shift Parallelism (sp2, both modes): which rank computes and sends which logits, and the
    gather's sizes, come from the host's copy of the plan (`logits.LogitsLayout`), so the forward and
    the gather read nothing from the device: a GPU's host never waits there for the step."""
    model_dir = make_tiny_checkpoint(tmp_path / "m", "llama-gqa")
    assert ranks.run(2, _two_rank_step_syncs, str(model_dir)) == [[], []]
