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
from shiftlm.serve.worker.compiled_step import MAX_BATCH
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
    """This rank's block of the sampled rows' logits of any step in full TP (prefill chunks, decode
    rows, both): the model's own layers with the `PLAIN` ops and `StepAttention`, its final norm and
    `head` (what `torch.compile` traces, the token count a symbolic size)."""
    hidden = model.hidden_states(ids[None], positions[None], StepAttention(storage), full_tp, PLAIN)[0]
    return F.linear(model.model.norm(hidden[rows], PLAIN), head)


class CompiledMixed:
    """Every step the decode path does not take (prefill chunks, alone or with decode rows; stream
    groups; decodes where no `CompiledDecode` runs) as one compiled graph
    for every token count (issue 34 item 2: "mixed prefill steps run compiled without graphs"): on
    CUDA the ~15 elementwise kernels a layer runs eagerly (norms, RoPE, SwiGLU, residual adds) fuse into
    a few around the GEMMs and the attention op. One rank, or full TP over the shift group (the sums
    traced, as `CompiledDecode`'s); SP x TP steps and MoE models stay eager."""

    def __init__(self, model: Transformer, cache: PagedKVCache, full_tp: FullTP | None = None, head=None):
        self.model, self.cache = model, cache
        self.full_tp = None if full_tp is None or full_tp.group.size == 1 else full_tp
        self.head = model.head_weight if head is None else head
        # its own code object (see CompiledDecode)
        fn = types.FunctionType(mixed_step.__code__.replace(), mixed_step.__globals__, "mixed_step")
        self._fn = torch.compile(fn, fullgraph=True)
        self.steps = 0

    def applies(self, batch: FlatBatch, mode: Mode) -> bool:
        """Any step without padding rows, in full TP where the shift group has several ranks."""
        return (mode is Mode.TP or self.full_tp is None) and batch.num_tokens == batch.slots.numel()

    @torch.no_grad()
    def __call__(self, batch: FlatBatch) -> torch.Tensor:
        """The sampled rows' logits [samples, padded vocab], as `ShiftModel.forward` returns them."""
        self.steps += 1
        storage = self.cache.storage
        _STEPS[storage.data_ptr()] = PagedAttention(self.cache, batch)
        try:
            return self._fn(
                self.model,
                batch.token_ids,
                batch.positions,
                batch.sample_rows,
                storage,
                self.head,
                self.full_tp,
            )
        finally:
            del _STEPS[storage.data_ptr()]

    @torch.no_grad()
    def warm_up(self, batch: FlatBatch) -> bool:
        """Compile now, one graph for every token count (>= 2) and sampled-row count, on `batch` (a
        step the caller made up over block 0), then zero the cache. False (after one warning line) where
        inductor fails to build: the caller then runs those steps eagerly."""
        start = time.perf_counter()
        torch._dynamo.mark_dynamic(batch.token_ids, 0, min=2, max=MAX_BATCH)
        torch._dynamo.mark_dynamic(batch.positions, 0, min=2, max=MAX_BATCH)
        torch._dynamo.decorators.mark_unbacked(batch.sample_rows, 0)
        try:
            self(batch)
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
