"""Alpha-beta collective costs whose bandwidth follows from where the group's ranks sit.

A group of n = k*m ranks, k per node on m nodes, runs hierarchically as NCCL does on multi-NIC nodes:
reduce-scatter inside the node over NVLink, then the inter-node step on each GPU's own NIC carrying
1/k of the data, then all-gather inside the node. Ring step costs are the standard
`(n-1)/n * bytes / bandwidth` (Thakur et al. 2005; Patarasuk & Yuan 2009); every ring step adds
`alpha`. Bandwidths are datasheet link rates times the fitted `intra_comm` / `inter_comm` factors.
"""

from __future__ import annotations

from dataclasses import dataclass

from shiftlm.hardware import Hardware
from shiftlm.sim.efficiency import Efficiency


@dataclass(frozen=True)
class Links:
    """Achievable per-GPU bandwidth (bytes/s) and per-step latency (s) inside and across nodes."""

    intra_bandwidth: float
    inter_bandwidth: float
    intra_latency: float
    inter_latency: float

    @classmethod
    def of(cls, hardware: Hardware, efficiency: Efficiency) -> Links:
        return cls(
            hardware.intra_node_bandwidth * efficiency.intra_comm,
            hardware.inter_node_bandwidth * efficiency.inter_comm,
            hardware.intra_node_latency,
            hardware.inter_node_latency,
        )


def _ring_half(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """One reduce-scatter or all-gather ring pass over `ranks` of a buffer of `nbytes`."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * latency + (ranks - 1) / ranks * nbytes / bandwidth


def reduce_scatter_time(nbytes: float, per_node: int, nodes: int, links: Links) -> float:
    """Reduce-scatter of a buffer of `nbytes` (the full, unsharded size) over per_node x nodes ranks."""
    intra = _ring_half(nbytes, per_node, links.intra_bandwidth, links.intra_latency)
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
        return Links(
            links.intra_bandwidth,
            links.inter_bandwidth,
            links.intra_latency + latency,
            links.inter_latency + latency,
        )
    latency = extra.get("handoff_latency", extra.get("p2p_latency", links.intra_latency))
    return Links(extra["p2p_bandwidth"], extra["p2p_bandwidth"], latency, latency)
