"""Communication: named groups, byte-counted collectives and their autograd pairs, P2P, the ledger."""

from shiftlm.comm.autograd import (
    all_to_all_along,
    all_to_all_rows,
    copy_to_group,
    gather_along,
    gather_replicated,
    reduce_from_group,
    reduce_scatter_along,
    split_along,
)
from shiftlm.comm.group import SINGLE, CommGroup, counters
from shiftlm.comm.ledger import CollectiveLedger, RankLedger, Record, TrackedWork, ledger, load_ledger
from shiftlm.comm.ops import (
    all_gather,
    all_gather_flat,
    all_reduce,
    all_to_all,
    all_to_all_uneven,
    broadcast,
    reduce_scatter,
    tree_all_reduce,
    tree_sum,
)
from shiftlm.comm.p2p import irecv, isend

__all__ = [
    "SINGLE",
    "CollectiveLedger",
    "CommGroup",
    "RankLedger",
    "Record",
    "TrackedWork",
    "all_gather",
    "all_gather_flat",
    "all_reduce",
    "all_to_all",
    "all_to_all_along",
    "all_to_all_rows",
    "all_to_all_uneven",
    "broadcast",
    "copy_to_group",
    "counters",
    "gather_along",
    "gather_replicated",
    "irecv",
    "isend",
    "ledger",
    "load_ledger",
    "reduce_from_group",
    "reduce_scatter",
    "reduce_scatter_along",
    "split_along",
    "tree_all_reduce",
    "tree_sum",
]
