"""Collectives that `torch.compile` can trace: custom ops around `comm.ops`, opaque to dynamo and
inductor, so a compiled graph keeps them in place instead of breaking at them (serving's compiled
full-TP decode step, serve/worker/compiled_step.py). A group travels into the op as the key
`register` gave it (custom ops take tensors, numbers and strings); the op calls the same
`comm.ops.all_reduce` as eager code: shared memory among a host's CPU ranks, gloo or NCCL otherwise.
No autograd: for forwards without gradients."""

from __future__ import annotations

import torch

from shiftlm.comm.group import CommGroup
from shiftlm.comm.ops import all_reduce

_GROUPS: dict[str, CommGroup] = {}


def register(group: CommGroup) -> str:
    """The key `traced_all_reduce` takes for `group` (made once per group object, outside the graph)."""
    key = f"{group}@{id(group):x}"
    _GROUPS[key] = group
    return key


@torch.library.custom_op("shiftlm::all_reduce", mutates_args=())
def traced_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """The sum of x over the group `register` keyed, out of place."""
    return all_reduce(x, _GROUPS[group])


@traced_all_reduce.register_fake
def _(x, group):
    return torch.empty_like(x)
