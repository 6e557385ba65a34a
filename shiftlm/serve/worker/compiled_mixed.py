"""Every step the compiled decode path does not take (prefill chunks, alone or with decode rows; stream
groups; decodes where no `CompiledDecode` runs) as one `torch.compile`d graph for every token count
(issue 34 item 2: "mixed prefill steps run compiled without graphs"): the model's own layers around
one opaque attention op a layer, `paged_step_attention`, which runs the step's eager `PagedAttention`.
"""

from __future__ import annotations

import logging
import os
import time
import types

import torch
import torch.nn.functional as F

from shiftlm.model.attention import FullTP
from shiftlm.model.ops import PLAIN
from shiftlm.model.transformer import Transformer
from shiftlm.serve.plan import Mode
from shiftlm.serve.worker.compiled_step import MAX_BATCH, ShiftModeSteps
from shiftlm.serve.worker.paged_attention import FlatBatch, PagedAttention, PagedKVCache

log = logging.getLogger(__name__)

# storage address -> the attention of the step a compiled mixed step is running (`CompiledMixed`)
_STEPS: dict[int, PagedAttention] = {}


@torch.library.custom_op("shiftlm::paged_step_attention", mutates_args=("storage",))
def paged_step_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, storage: torch.Tensor, layer: int
) -> torch.Tensor:
    """One layer's eager attention of the step running on `storage`'s cache (`PagedAttention` over its
    groups: decode rows, prefill chunks, stream groups): K/V [N, Hkv, D] written, q [N, Hq, D] ->
    [N, Hq, D]. Opaque to inductor, so a mixed step's groups keep their eager code and shapes while
    everything around them compiles."""
    return _STEPS[storage.data_ptr()](layer, q[None], k[None], v[None])[0]


@paged_step_attention.register_fake
def _(q, k, v, storage, layer):
    return torch.empty_like(q)


class StepAttention:
    """The attention backend of a compiled mixed step: each layer's call is one `paged_step_attention`."""

    def __init__(self, storage: torch.Tensor):
        self.storage = storage

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return paged_step_attention(q[0], k[0], v[0], self.storage, layer).unsqueeze(0)


def mixed_step(model: Transformer, ids, positions, rows, storage, head, full_tp):
    """This rank's block of the sampled rows' logits of any step (prefill chunks, decode rows, both):
    the model's own layers with the `PLAIN` ops and `StepAttention`, its final norm and `head` (what
    `torch.compile` traces, the token count a symbolic size). `ids`, `positions`: the tokens this
    rank embeds, every row in full TP (over the shift group where `full_tp` is given), its slice of
    the (padded) batch in SP x TP (`compiled_step.sp_slice`)."""
    hidden = model.hidden_states(ids[None], positions[None], StepAttention(storage), full_tp, PLAIN)[0]
    return F.linear(model.model.norm(hidden[rows], PLAIN), head)


class CompiledMixed(ShiftModeSteps):
    """Every step the decode path does not take (prefill chunks, alone or with decode rows; stream
    groups; decodes where no `CompiledDecode` runs) as one compiled graph
    for every token count (issue 34 item 2: "mixed prefill steps run compiled without graphs"): on
    CUDA the ~15 elementwise kernels a layer runs eagerly (norms, RoPE, SwiGLU, residual adds) fuse into
    a few around the GEMMs and the attention op. One rank, or a shift group of several: full TP, and
    SP x TP where `ulysses` is given (a graph per mode, as `CompiledDecode`'s); MoE models stay eager."""

    def __init__(
        self,
        model: Transformer,
        cache: PagedKVCache,
        full_tp: FullTP | None = None,
        head=None,
        ulysses: tuple[int, int] | None = None,
    ):
        super().__init__(model, full_tp, head, ulysses)
        self.cache = cache
        # its own code object (see CompiledDecode)
        fn = types.FunctionType(mixed_step.__code__.replace(), mixed_step.__globals__, "mixed_step")
        self._fn = torch.compile(fn, fullgraph=True)
        self.steps = 0

    def applies(self, batch: FlatBatch, mode: Mode) -> bool:
        """Any step of a mode with a graph (full TP's have no padding rows; SP x TP's may)."""
        return self.graph_mode(mode) is not None

    @torch.no_grad()
    def __call__(self, batch: FlatBatch, mode: Mode, rows: torch.Tensor) -> torch.Tensor:
        """This rank's logits block (`rows`: its hidden rows, `logits.logits_block`), as
        `ShiftModel.forward` returns it."""
        self.steps += 1
        storage = self.cache.storage
        ids, positions, head, full_tp = self.mode_inputs(mode, batch.token_ids, batch.positions)
        _STEPS[storage.data_ptr()] = PagedAttention(self.cache, batch)
        try:
            return self._fn(self.model, ids, positions, rows, storage, head, full_tp)
        finally:
            del _STEPS[storage.data_ptr()]

    @torch.no_grad()
    def warm_up(self, steps: list[tuple[Mode, FlatBatch, torch.Tensor]]) -> bool:
        """Compile now, one graph per (mode, batch, hidden rows) of `steps` (steps the caller made up
        over block 0: full TP's, and SP x TP's where the modes differ), then zero the cache. Full TP's
        step of 2 tokens compiles the graph of every token count from 2 (and any sampled-row count);
        SP x TP's steps of sp and 2 x sp tokens (slices of 1 and 2 rows) the graph of a 1-row slice
        (a size of 1 is specialized) and, the slice's length changing, dynamo's graph of every length
        from 2. False (after one warning line) where inductor fails to build: the caller then runs
        those steps eagerly."""
        start = time.perf_counter()
        try:
            for mode, batch, rows in steps:
                if self.graph_mode(mode) is Mode.TP:  # SP x TP: slices of 1 then 2, made dynamic by dynamo
                    torch._dynamo.mark_dynamic(batch.token_ids, 0, min=2, max=MAX_BATCH)
                    torch._dynamo.mark_dynamic(batch.positions, 0, min=2, max=MAX_BATCH)
                torch._dynamo.decorators.mark_unbacked(rows, 0)
                self(batch, mode, rows)
        except Exception as err:  # noqa: BLE001 - inductor, or tracing on an untried platform
            log.warning(
                "the compiled mixed step could not be built (%s: %s); running it eagerly",
                type(err).__name__,
                (str(err).splitlines() or [""])[0],
            )
            return False
        finally:
            self.cache.storage.zero_()
            self.steps = 0
        if int(os.environ.get("RANK", "0")) == 0:
            log.info("compiled the prefill and mixed steps in %.1f s", time.perf_counter() - start)
        return True
