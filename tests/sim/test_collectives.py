"""Group placement follows the rank layout; spanning nodes costs NIC bandwidth."""

from __future__ import annotations

from shiftlm.hardware import CATALOG
from shiftlm.sim.collectives import Links, all_reduce_time, all_to_all_time
from shiftlm.sim.efficiency import FIRST_PRINCIPLES
from shiftlm.sim.layout import MEGATRON_ORDER, Layout, group_placement

LINKS = Links.of(CATALOG["a100-80gb"], FIRST_PRINCIPLES)


def test_tp_inside_a_node_and_dp_across_nodes_in_shiftlm_order():
    layout = Layout(dp=8, pp=2, tp=8)
    assert group_placement(layout, "tp", 8) == (8, 1)
    assert group_placement(layout, "pp", 8) == (1, 2)
    assert group_placement(layout, "dp", 8) == (1, 8)


def test_megatron_order_puts_dp_before_pp():
    shiftlm = Layout(dp=4, pp=4, tp=2)
    megatron = Layout(dp=4, pp=4, tp=2, rank_order=MEGATRON_ORDER)
    assert group_placement(shiftlm, "dp", 8) == (1, 4)
    assert group_placement(megatron, "dp", 8) == (4, 1)


def test_all_reduce_across_nodes_is_slower_than_inside_one():
    nbytes = 256 * 2**20
    assert all_reduce_time(nbytes, 1, 8, LINKS) > all_reduce_time(nbytes, 8, 1, LINKS)
    # hierarchical: more GPUs per node share the inter-node step, so it gets cheaper
    assert all_reduce_time(nbytes, 8, 4, LINKS) < all_reduce_time(nbytes, 1, 32, LINKS)


def test_single_rank_groups_cost_nothing():
    assert all_reduce_time(1e9, 1, 1, LINKS) == 0.0
    assert all_to_all_time(1e9, 1, 1, LINKS) == 0.0


def test_all_reduce_bus_bandwidth_is_two_n_minus_one_over_n():
    nbytes, ranks = 1e9, 8
    no_latency = Links(LINKS.intra_bandwidth, LINKS.inter_bandwidth, 0.0, 0.0)
    expected = 2 * (ranks - 1) / ranks * nbytes / LINKS.intra_bandwidth
    assert abs(all_reduce_time(nbytes, ranks, 1, no_latency) - expected) < 1e-12


def test_pipeline_handoffs_use_the_calibrated_latency_where_measured():
    from dataclasses import replace

    from shiftlm.hardware import CATALOG
    from shiftlm.sim.collectives import Links, p2p_links
    from shiftlm.sim.efficiency import MEASURED

    gpu = CATALOG["h100-sxm"]
    assert p2p_links(gpu, MEASURED) == Links.of(gpu, MEASURED)  # catalog: the collective links
    this = replace(gpu, extra={"p2p_latency": 60e-6, "p2p_bandwidth": 2e9, "handoff_latency": 1.5e-3})
    links = p2p_links(this, MEASURED)
    assert links.intra_latency == 1.5e-3 and links.intra_bandwidth == 2e9
    older = replace(gpu, extra={"p2p_latency": 60e-6, "p2p_bandwidth": 2e9})  # a profile from before
    assert p2p_links(older, MEASURED).intra_latency == 60e-6
