"""Alpha-beta collective costs whose bandwidth follows from where the group's ranks sit.

A group of n = k*m ranks, k per node on m nodes, runs hierarchically as NCCL does on multi-NIC nodes:
reduce-scatter inside the node over NVLink, then the inter-node step on each GPU's own NIC carrying
1/k of the data, then all-gather inside the node. Ring step costs are the standard
`(n-1)/n * bytes / bandwidth` (Thakur et al. 2005; Patarasuk & Yuan 2009); every ring step adds
`alpha`. Bandwidths are datasheet link rates times the fitted `intra_comm` / `inter_comm` factors.
Where the cluster has measured all-reduce times for a group size inside one node
(`Hardware.allreduce_table`, nccl-tests), the intra-node part takes the measured time of its size
instead: small collectives there cost tens of microseconds more than the alpha-beta model says
(vTrain's A100 node: 1 MiB over 2 GPUs 45 us, over 8 GPUs 92 us).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, replace

from shiftlm.hardware import Hardware
from shiftlm.sim.efficiency import Efficiency


@dataclass(frozen=True)
class Links:
    """Achievable per-GPU bandwidth (bytes/s) and per-step latency (s) inside and across nodes."""

    intra_bandwidth: float
    inter_bandwidth: float
    intra_latency: float
    inter_latency: float
    allreduce_table: tuple = ()  # Hardware.allreduce_table: measured intra-node all-reduce times

    @classmethod
    def of(cls, hardware: Hardware, efficiency: Efficiency) -> Links:
        """A cluster with measured intra-node all-reduces states its NVLink rate as measured too
        (the bus bandwidth of its largest all-reduce), so `intra_comm` does not scale it."""
        intra = 1.0 if hardware.allreduce_table else efficiency.intra_comm
        return cls(
            hardware.intra_node_bandwidth * intra,
            hardware.inter_node_bandwidth * efficiency.inter_comm,
            hardware.intra_node_latency,
            hardware.inter_node_latency,
            hardware.allreduce_table,
        )


def measured_all_reduce_time(table: tuple, ranks: int, nbytes: float) -> float | None:
    """The measured all-reduce time of `nbytes` over `ranks` GPUs of one node, interpolated
    linearly between the table's sizes, or None where the table has no such group. Below its
    smallest size the smallest size's time (a latency floor: 1 MiB is latency-bound already);
    above its largest, that size's bus bandwidth (as vTrain's predictor extrapolates)."""
    for group, sizes, times in table:
        if group != ranks:
            continue
        if nbytes <= sizes[0]:
            return times[0]
        if nbytes >= sizes[-1]:
            return times[-1] * nbytes / sizes[-1]
        i = bisect_left(sizes, nbytes)
        share = (nbytes - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
        return times[i - 1] + share * (times[i] - times[i - 1])
    return None


def _ring_half(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """One reduce-scatter or all-gather ring pass over `ranks` of a buffer of `nbytes`."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * latency + (ranks - 1) / ranks * nbytes / bandwidth


def _intra_half(nbytes: float, ranks: int, links: Links) -> float:
    """The reduce-scatter (or all-gather) half of an all-reduce over `ranks` GPUs of one node:
    half the measured all-reduce where the cluster has one for the group, else one ring pass."""
    measured = measured_all_reduce_time(links.allreduce_table, ranks, nbytes) if ranks > 1 else None
    if measured is not None:
        return measured / 2
    return _ring_half(nbytes, ranks, links.intra_bandwidth, links.intra_latency)


def reduce_scatter_time(nbytes: float, per_node: int, nodes: int, links: Links) -> float:
    """Reduce-scatter of a buffer of `nbytes` (the full, unsharded size) over per_node x nodes ranks."""
    intra = _intra_half(nbytes, per_node, links)
    inter = _ring_half(nbytes / per_node, nodes, links.inter_bandwidth, links.inter_latency)
    return intra + inter


def all_reduce_time(nbytes: float, per_node: int, nodes: int, links: Links) -> float:
    """All-reduce = reduce-scatter + all-gather (ring; bus bandwidth 2(n-1)/n)."""
    return 2 * reduce_scatter_time(nbytes, per_node, nodes, links)


def all_to_all_time(nbytes: float, per_node: int, nodes: int, links: Links) -> float:
    """All-to-all where each rank holds `nbytes` and keeps 1/n of it (Ulysses, Jacobs et al. 2023).

    Pairwise exchange: the share for ranks in other nodes leaves over the NIC, the rest over NVLink.
    """
    ranks = per_node * nodes
    if ranks <= 1:
        return 0.0
    remote = nbytes * (ranks - per_node) / ranks
    local = nbytes * (per_node - 1) / ranks
    latency = (per_node - 1) * links.intra_latency + (ranks - per_node) * links.inter_latency
    return latency + max(local / links.intra_bandwidth, remote / links.inter_bandwidth)


def p2p_time(nbytes: float, crosses_node: bool, links: Links) -> float:
    """One point-to-point send (pipeline activations or gradients)."""
    if crosses_node:
        return links.inter_latency + nbytes / links.inter_bandwidth
    return links.intra_latency + nbytes / links.intra_bandwidth


def p2p_links(hardware: Hardware, efficiency: Efficiency) -> Links:
    """Links for pipeline hand-offs. A calibrated profile (`shiftlm calibrate`) carries its own:
    the send/recv bandwidth, and the latency of a hand-off as the executor makes it (a header, then
    the activation) while the sender goes on computing, which on a CPU host is set by when the
    sender's communication threads get a core (~2 ms here against ~0.1 ms for an idle ping-pong).
    Catalog GPUs use their collective links."""
    links, extra = Links.of(hardware, efficiency), hardware.extra
    if "p2p_bandwidth" not in extra:  # not a calibrated profile: add the hand-off's fixed cost
        latency = efficiency.handoff_latency
        return replace(
            links,
            intra_latency=links.intra_latency + latency,
            inter_latency=links.inter_latency + latency,
        )
    latency = extra.get("handoff_latency", extra.get("p2p_latency", links.intra_latency))
    return Links(extra["p2p_bandwidth"], extra["p2p_bandwidth"], latency, latency)
