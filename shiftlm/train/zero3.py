"""ZeRO-3 parameter sharding (Rajbhandari et al. 2020, §5.3 P_p; the FSDP pattern, Zhao et al. 2023).

At rest a rank holds only its fp32 master shard of every unit (1/N of each decoder layer, of the
embedding, of the final norm + head; N = the data group, `dp_sp`). A unit's full parameters live in
one buffer whose storage is allocated only while it is in use:
- forward: just before the unit runs, its buffer is all-gathered (and the next unit's gather is
  started, so it overlaps this unit's compute); right after, the buffer's storage is freed;
- backward: a hook on the unit's output gathers it again before autograd runs the unit's backward
  (and starts the previous unit's gather); a hook on the unit's input frees it once autograd has
  produced that input's gradient, i.e. once the whole unit's backward has run. The embedding's
  backward needs no weights, so it is not gathered there.
Parameters are views of the buffer, so the tensors autograd saved in forward see the regathered
values (the storage is resized, never replaced). Deferred weight gradients (the W of zero-bubble
schedules) need X and dY only, not the weights. Under full recomputation the forward rerun inside
backward keeps the unit gathered (the output hook has gathered it).

Why our own and not FSDP2's `fully_shard`: our tensor-parallel layers keep plain local tensors
(shards are sliced by `model/sharding.py`, not DTensors) and our trainer owns the flat fp32
buffers, the bucketed sync, the pipeline executor's I/W split and layout-free checkpoints;
`fully_shard` would turn parameters into DTensors on a 1-D (or HSDP 2-D) mesh, replace our flat
gradient buffer with its own reduce-scatter, and its pipeline support is tied to
`torch.distributed.pipelining`'s stages. Gathering per unit over our own group keeps every
existing layout and test unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from shiftlm.comm import CommGroup, all_gather_flat
from shiftlm.train.flat import PARAMS_TAG, FlatParameters

_LAYER = re.compile(r"(?:replica\d+\.)?model\.layers\.(\d+)\.")


def unit_labels(names: list[str]) -> list[str]:
    """The ZeRO-2/3 unit of each flat parameter name: its decoder layer, the embedding, the final norm,
    or the LM head (its own unit, as long as the embedding: a tied copy's shard then covers the same
    elements as the table's, `grad_shards.sync_tied`); BitPipe's second replica (`replica1.` names)
    gets units of its own."""
    labels = []
    for name in names:
        prefix = name.split("model.")[0] if name.startswith("replica") else ""
        match = _LAYER.match(name)
        if match:
            labels.append(f"{prefix}layer{match.group(1)}")
        elif "embed_tokens" in name:
            labels.append(f"{prefix}embed")
        elif name.split(".")[-2:-1] == ["lm_head"] or name.endswith("lm_head.weight"):
            labels.append(
                f"{prefix}lm_head"
            )  # a unit of its own: a tied copy's shard lines up with the table's
        else:
            labels.append(f"{prefix}head")
    return labels


class ParameterShards:
    """Owns the master shards and the per-unit full buffers of a ZeRO-3 rank; wraps the stages."""

    def __init__(
        self, flat: FlatParameters, groups: CommGroup | list[CommGroup], ranges: list[tuple[int, int]]
    ):
        """`groups`: the data group of every unit (one for all, or one per unit: routed experts over `edp`)."""
        if isinstance(groups, CommGroup):
            groups = [groups] * len(flat.units)
        self.flat, self.groups = flat, groups
        with torch.profiler.record_function(PARAMS_TAG):
            self.master = [flat.params[a:b].clone() for a, b in ranges]  # fp32, updated by the optimizer
        self.buffers: list[torch.Tensor] = []
        self._handles: dict[int, Any] = {}
        self._gathered = [False] * len(flat.units)
        self.current_bytes = sum(t.numel() * t.element_size() for t in self.master)
        self.peak_bytes = self.checkpoint_peak_bytes = 0
        with torch.no_grad():
            for unit, (offset, length) in enumerate(flat.units):  # one unit's copy at a time
                with torch.profiler.record_function(PARAMS_TAG):
                    buffer = flat.params[offset : offset + length].clone()
                self.buffers.append(buffer)
                for index in (i for i, u in enumerate(flat.unit_of) if u == unit):
                    slot, param = flat.slots[index], flat.parameters[index]
                    param.data = buffer[slot.offset - offset : slot.offset - offset + slot.numel].view(
                        slot.shape
                    )
                buffer.untyped_storage().resize_(0)  # sharded at rest: gathered around its use
        # the full flat copy is gone: shards + in-use units only
        flat.params = torch.empty(0, device=flat.device)
        self.peak_bytes = self.current_bytes

    # -- gather / free -----------------------------------------------------------------------------
    def _account(self, delta: int) -> None:
        self.current_bytes += delta
        if delta > 0:
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def _allocate(self, unit: int) -> torch.Tensor:
        buffer = self.buffers[unit]
        storage = buffer.untyped_storage()
        nbytes = buffer.numel() * buffer.element_size()
        if storage.nbytes() == 0:
            with torch.profiler.record_function(PARAMS_TAG):
                storage.resize_(nbytes)
            self._account(nbytes)
        return buffer

    def prefetch(self, unit: int | list[int] | None) -> None:
        """Start gathering `unit` (or each of a list) asynchronously (no-op if gathered or on its way)."""
        if isinstance(unit, list):
            for one in unit:
                self.prefetch(one)
            return
        if unit is None or self._gathered[unit] or unit in self._handles:
            return
        buffer = self._allocate(unit)
        self._handles[unit] = all_gather_flat(buffer, self.master[unit], self.groups[unit], async_op=True)

    @torch.no_grad()
    def gather(self, unit: int) -> None:
        """Make `unit`'s full parameters present (waiting for a prefetch if one is in flight)."""
        if self._gathered[unit]:
            return
        self.prefetch(unit)
        self._handles.pop(unit).wait()
        self._gathered[unit] = True

    def free(self, unit: int) -> None:
        """Release `unit`'s full buffer (its views stay valid objects; their storage is empty)."""
        if not self._gathered[unit]:
            return
        buffer = self.buffers[unit]
        nbytes = buffer.untyped_storage().nbytes()
        buffer.untyped_storage().resize_(0)
        self._account(-nbytes)
        self._gathered[unit] = False

    @contextmanager
    def gathered(self, write_back: bool = False) -> Iterator[None]:
        """Every unit gathered inside (checkpoint save / load, as FSDP's full state dict); with
        `write_back`, the values the block wrote into the parameters become the master shards."""
        peak = self.peak_bytes  # a checkpoint's full gather is counted apart from the training peak
        for unit in range(len(self.buffers)):
            self.gather(unit)
        self.checkpoint_peak_bytes = max(self.checkpoint_peak_bytes, self.current_bytes)
        self.peak_bytes = peak
        try:
            yield
        finally:
            if write_back:
                with torch.no_grad():
                    for unit, ((_, length), shard) in enumerate(zip(self.flat.units, self.master)):
                        size = length // self.groups[unit].size
                        start = self.groups[unit].rank * size
                        shard.copy_(self.buffers[unit][start : start + size])
            for unit in range(len(self.buffers)):
                self.free(unit)

    # -- hooks -------------------------------------------------------------------------------------
    def wrap(
        self, stages: list[torch.nn.Module], stage_units: list[list[list[int]]], tied: list[bool]
    ) -> None:
        """Gather-before-use around each unit of each stage: its embedding, decoder layers and head.

        `stage_units[i]`: the units of stage i's modules in forward order (embedding, layers..., final
        norm, LM head; those it has), a list per module (a layer with routed experts has their unit
        too); `tied[i]`: stage i's head reads the embedding's weight (then the head gathers both)."""
        for stage, units, is_tied in zip(stages, stage_units, tied):
            modules: list[tuple[Any, str]] = []
            if stage.with_embedding:
                modules.append((stage.model.embed_tokens, "forward"))
            modules += [(layer, "forward") for layer in stage.model.layers.values()]
            if stage.with_head:  # the head runs in `loss` when it is chunked (`Transformer.loss_chunk`)
                modules.append((stage, "loss" if stage.loss_chunk else "head"))
            for position, ((owner, attribute), unit) in enumerate(zip(modules, units)):
                head = attribute in ("head", "loss")
                extra = list(units[0]) if is_tied and head else []
                if head:  # the final norm's unit, then the LM head's
                    extra += [u for rest in units[len(modules) :] for u in rest]
                embedding = stage.with_embedding and position == 0
                nxt = units[position + 1] if position + 1 < len(units) else None
                prev = (
                    units[position - 1]
                    if position > 0 and not (stage.with_embedding and position == 1)
                    else None
                )
                setattr(
                    owner,
                    attribute,
                    self._wrapped(getattr(owner, attribute), [*unit, *extra], nxt, prev, not embedding),
                )

    def _wrapped(
        self,
        fn: Callable,
        units: list[int],
        nxt: list[int] | None,
        prev: list[int] | None,
        backward_needs_weights: bool,
    ) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            for unit in units:
                self.gather(unit)
            in_backward = torch._C._current_graph_task_id() != -1  # a recomputation inside backward
            if not in_backward:
                self.prefetch(nxt)
            out = fn(*args, **kwargs)
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if torch.is_grad_enabled() and out.requires_grad and backward_needs_weights and not in_backward:
                consumers: list[int] = []  # units that take `out` as input: done once its grad exists

                def before_backward(grad: torch.Tensor) -> None:
                    for unit in consumers:  # free the next unit first (its hook would run after this)
                        self.free(unit)
                    for unit in units:
                        self.gather(unit)
                    self.prefetch(prev)

                out.register_hook(before_backward)
                out._zero3_consumers = consumers
                if x is not None and x.requires_grad:
                    getattr(x, "_zero3_consumers", []).extend(units)
                    x.register_hook(lambda grad: [self.free(unit) for unit in units] and None)
            if not in_backward:
                for unit in units:
                    self.free(unit)
            return out

        return run
