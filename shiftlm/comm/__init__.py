"""Communication: named groups, byte-counted collectives and their autograd pairs, P2P."""

from shiftlm.comm.group import SINGLE, CommGroup, counters
from shiftlm.comm.ops import (
    all_gather,
    all_reduce,
    all_to_all,
    all_to_all_along,
    broadcast,
    copy_to_group,
    gather_along,
    gather_replicated,
    reduce_from_group,
    reduce_scatter,
    reduce_scatter_along,
    split_along,
)

__all__ = [
    "SINGLE",
    "CommGroup",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_along",
    "broadcast",
    "copy_to_group",
    "counters",
    "gather_along",
    "gather_replicated",
    "reduce_from_group",
    "reduce_scatter",
    "reduce_scatter_along",
    "split_along",
]
