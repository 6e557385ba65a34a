"""Group placement follows the rank layout; spanning nodes costs NIC bandwidth."""

from __future__ import annotations

from dataclasses import replace

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


# A made-up measured table: 2 GPUs take 40 us up to 1 MiB, then 100 us at 2 MiB and 1 ms at 64 MiB.
MEASURED_ROWS = ((2, (2.0**20, 2.0**21, 2.0**26), (40e-6, 100e-6, 1e-3)),)


def test_a_measured_all_reduce_table_times_intra_node_groups_it_has():
    from shiftlm.sim.collectives import measured_all_reduce_time

    assert measured_all_reduce_time(MEASURED_ROWS, 2, 2.0**19) == 40e-6  # below the table: its floor
    assert abs(measured_all_reduce_time(MEASURED_ROWS, 2, 1.5 * 2.0**20) - 70e-6) < 1e-12  # linear
    assert abs(measured_all_reduce_time(MEASURED_ROWS, 2, 2.0**27) - 2e-3) < 1e-12  # its last bus bandwidth
    assert measured_all_reduce_time(MEASURED_ROWS, 4, 2.0**21) is None  # no such group measured
    gpu = replace(CATALOG["a100-80gb"], allreduce_table=MEASURED_ROWS)
    links = Links.of(gpu, FIRST_PRINCIPLES)
    assert links.intra_bandwidth == gpu.intra_node_bandwidth  # measured: no efficiency factor
    assert abs(all_reduce_time(2.0**21, 2, 1, links) - 100e-6) < 1e-12
    # groups the table lacks keep the link model; a group across nodes uses the table inside each
    assert all_reduce_time(2.0**21, 4, 1, links) == all_reduce_time(
        2.0**21, 4, 1, replace(links, allreduce_table=())
    )
    across = all_reduce_time(2.0**21, 2, 2, links)
    inter = all_reduce_time(2.0**21 / 2, 1, 2, links)
    assert abs(across - (100e-6 + inter)) < 1e-12


def test_vtrain_testbed_carries_its_published_nccl_measurements():
    from shiftlm.sim.collectives import measured_all_reduce_time
    from shiftlm.sim.measured import vtrain_testbed

    gpu = vtrain_testbed()
    assert [ranks for ranks, _, _ in gpu.allreduce_table] == [2, 3, 4, 5, 6, 7, 8]
    for _, sizes, times in gpu.allreduce_table:
        assert len(sizes) == 1024 and sizes[0] == 2**20 and sizes[-1] == 2**30
        assert all(b - a == 2**20 for a, b in zip(sizes, sizes[1:]))
        assert all(t > 0 for t in times)
    # the files' own numbers: 8 GPUs, 1 MiB in 92 us (in place); bus bandwidth at 1 GiB ~220 GB/s
    assert abs(measured_all_reduce_time(gpu.allreduce_table, 8, 2**20) - 92.15e-6) < 1e-9
    assert 200e9 < gpu.intra_node_bandwidth < 240e9
    assert gpu.inter_node_bandwidth == 100e9 / 8


def test_a_profile_with_an_all_reduce_table_round_trips(tmp_path):
    from shiftlm.hardware import load_profile, save_profile

    gpu = replace(CATALOG["a100-80gb"], allreduce_table=MEASURED_ROWS)
    save_profile(gpu, tmp_path / "hw.json")
    assert load_profile(tmp_path / "hw.json") == gpu
