"""This rank's trainable parameters in one flat fp32 buffer, and their gradients in another.

Each parameter's `.data` and `.grad` become views into the two buffers (as DDP's
`gradient_as_bucket_view`), so a bucket of gradients is a contiguous slice that one collective can
reduce in place, and a ZeRO shard is a contiguous range that one all-gather can refill.

Sharding units: by default the whole buffer is one unit, padded to a multiple of the sharding group
size (ZeRO-1/2: rank r owns the r-th 1/N of everything). With `units` (one label per parameter,
consecutive parameters with the same label form a unit), every unit is padded on its own, so rank r
owns the r-th 1/N of every unit: ZeRO-3 gathers and frees one unit (a decoder layer) at a time, as
FSDP's per-module flat parameters do.

`full_grads=False` (ZeRO-2/3 with a data group of more than one rank): no full-size gradient buffer;
`.grad` stays None between uses and `train/grad_shards.py` keeps only this rank's 1/N shard of the
gradients (plus a unit's buffer while it is being reduced). Masks can be built at shard size too.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

GRADS_TAG = "shiftlm.grads"  # profiler ranges around every gradient / parameter storage allocation
PARAMS_TAG = "shiftlm.params"  # (train/memory_probe.tagged_peak attributes the allocator's bytes)


def hook_arrivals(
    flat: FlatParameters, arrived: Callable[[int], None], hooked: list[bool] | None = None
) -> None:
    """After autograd accumulates a gradient into parameter i (of those `hooked`), call `arrived(i)`, a
    bound method, through a weak reference to its owner. A parameter keeps its hooks where Python's
    collector cannot follow them (autograd's gradient accumulator holds the tensor from C++), so a hook
    holding its owner strongly made an uncollectable cycle: every training run in a process left its
    gradient buffers and its process groups' threads behind (3 gloo threads a run, each test worker
    polling in all of them)."""
    owner = weakref.WeakMethod(arrived)
    for index, param in enumerate(flat.parameters):
        if hooked is None or hooked[index]:
            param.register_post_accumulate_grad_hook(functools.partial(_arrive, owner, index))


def _arrive(owner: weakref.WeakMethod, index: int, _param: torch.Tensor) -> None:
    arrived = owner()
    if arrived is not None:
        arrived(index)


@dataclass(frozen=True)
class FlatSlot:
    """Where one parameter lives in the flat buffers."""

    name: str
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


class FlatParameters:
    def __init__(
        self,
        named_parameters: list[tuple[str, torch.nn.Parameter]],
        pad_to: int = 1,
        units: list[str] | None = None,
        device: torch.device | None = None,
        full_grads: bool = True,
    ):
        """`device`: where the flat buffers live (by default the parameters' device); `full_grads`:
        whether to keep the full-size gradient buffer (`.grad` views into it)."""
        self.parameters = [param for _, param in named_parameters]
        self.slots: list[FlatSlot] = []
        self.units: list[tuple[int, int]] = []  # (offset, padded length) of each sharding unit
        self.unit_of: list[int] = []  # parameter index -> unit index
        labels = units if units is not None else [""] * len(named_parameters)
        offset, unit_start = 0, 0
        for index, (name, param) in enumerate(named_parameters):
            self.slots.append(FlatSlot(name, offset, tuple(param.shape)))
            self.unit_of.append(len(self.units))
            offset += param.numel()
            if index + 1 == len(named_parameters) or labels[index + 1] != labels[index]:
                length = -(-max(offset - unit_start, 1) // pad_to) * pad_to
                self.units.append((unit_start, length))
                offset = unit_start = unit_start + length
        self.numel = sum(slot.numel for slot in self.slots)
        padded = max(offset, pad_to)
        if not self.units:
            self.units.append((0, padded))
        if device is None:
            device = self.parameters[0].device if self.parameters else torch.device("cpu")
        self.padded, self.device = padded, device
        with torch.profiler.record_function(PARAMS_TAG):
            self.params = torch.zeros(padded, dtype=torch.float32, device=device)
        self.grads = None
        if full_grads:
            with torch.profiler.record_function(GRADS_TAG):  # (memory_probe.tagged_peak finds it)
                self.grads = torch.zeros(padded, dtype=torch.float32, device=device)
        with torch.no_grad():
            for slot, param in zip(self.slots, self.parameters):
                self.params[slot.offset : slot.offset + slot.numel].copy_(param.reshape(-1))
                param.data = self.view(self.params, slot)
                param.grad = self.view(self.grads, slot) if full_grads else None

    @staticmethod
    def view(buffer: torch.Tensor, slot: FlatSlot) -> torch.Tensor:
        return buffer[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def unflatten(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-parameter views of a flat buffer laid out like `params` (e.g. an Adam moment)."""
        return {slot.name: self.view(buffer, slot) for slot in self.slots}

    def flatten(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The inverse of `unflatten`: a new padded flat buffer from per-parameter tensors."""
        buffer = self.zeros()  # (ZeRO-3 frees `params`)
        for slot in self.slots:
            self.view(buffer, slot).copy_(tensors[slot.name].reshape(slot.shape))
        return buffer

    def zeros(self) -> torch.Tensor:
        """A new full-size fp32 buffer laid out like `params`."""
        return torch.zeros(self.padded, dtype=torch.float32, device=self.device)

    def mask(self, keep, ranges: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """A flat 0/1 buffer: 1 on the parameters for which `keep(name, shape)` is true. With `ranges`
        only those [start, end) pieces of it, concatenated (a shard-size mask: no full-size one made)."""
        if ranges is None:
            ranges = [(0, self.padded)]
        pieces = [torch.zeros(b - a, dtype=torch.float32, device=self.device) for a, b in ranges]
        for slot in self.slots:
            if not keep(slot.name, slot.shape):
                continue
            for (a, b), piece in zip(ranges, pieces):
                start, end = max(a, slot.offset), min(b, slot.offset + slot.numel)
                if start < end:
                    piece[start - a : end - a].fill_(1.0)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def zero_grad(self) -> None:
        if self.grads is None:  # sharded gradients: `train/grad_shards.py` owns them
            return
        self.grads.zero_()
        self.adopt_grads()

    @torch.no_grad()
    def adopt_grads(self, indices: list[int] | None = None) -> None:
        """Bring back gradients that code outside autograd's accumulation replaced (`p.grad = g`,
        as the pipeline executor does): copy them into the flat buffer and point `.grad` at it again.
        `indices`: only these parameters (default: all)."""
        if self.grads is None:
            return
        for index in range(len(self.parameters)) if indices is None else indices:
            slot, param = self.slots[index], self.parameters[index]
            view = self.view(self.grads, slot)
            if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                if param.grad is not None:
                    view.copy_(param.grad)
                param.grad = view
