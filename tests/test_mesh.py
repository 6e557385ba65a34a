"""Rank layout: rank = (((dp*PP + pp)*CP + cp)*SP + sp)*TP + tp, TP innermost; shift-group head order
j = tp*SP + sp."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftlm.errors import ConfigError
from shiftlm.mesh import Mesh, coords_of, group_ranks, rank_of
from shiftlm.parallel import ParallelConfig

sizes = st.integers(min_value=1, max_value=3)


@settings(max_examples=60, deadline=None)
@given(dp=sizes, pp=sizes, sp=sizes, tp=sizes, cp=sizes)
def test_groups_partition_the_world_along_each_axis(dp, pp, sp, tp, cp):
    config = ParallelConfig(dp=dp, pp=pp, sp=sp, tp=tp, cp=cp)
    for rank in range(config.world_size):
        assert rank_of(config, **vars(coords_of(config, rank))) == rank
    axis_sizes = (
        (("tp",), tp),
        (("sp",), sp),
        (("cp",), cp),
        (("pp",), pp),
        (("dp",), dp),
        (("tp", "sp"), tp * sp),
        (("dp", "cp", "sp"), dp * cp * sp),
    )
    for axes, size in axis_sizes:
        groups = group_ranks(config, axes)
        assert sorted(r for g in groups for r in g) == list(range(config.world_size))
        assert all(len(g) == size for g in groups)


def test_tp_is_innermost_and_sp_strides_by_tp():
    config = ParallelConfig(dp=1, pp=2, sp=2, tp=2)
    assert group_ranks(config, ("tp",))[:2] == [[0, 1], [2, 3]]
    assert group_ranks(config, ("sp",))[:2] == [[0, 2], [1, 3]]
    assert group_ranks(config, ("pp",))[0] == [0, 4]


def test_cp_sits_between_pp_and_sp():
    config = ParallelConfig(dp=1, pp=2, cp=2, sp=2, tp=2)
    assert group_ranks(config, ("sp",))[0] == [0, 2]
    assert group_ranks(config, ("cp",))[0] == [0, 4]  # stride SP*TP
    assert group_ranks(config, ("pp",))[0] == [0, 8]  # stride CP*SP*TP
    # the ranks that hold the same weights and see different tokens: cp x sp at fixed (pp, tp)
    assert group_ranks(config, ("dp", "cp", "sp"))[0] == [0, 2, 4, 6]
    mesh = Mesh(config, rank=13, world_size=16)
    assert (mesh.coords.pp, mesh.coords.cp, mesh.coords.sp, mesh.coords.tp) == (1, 1, 0, 1)
    assert mesh.cp.ranks == (9, 13) and mesh.dp_sp.ranks == (9, 11, 13, 15)
    assert str(mesh) == "DP(1)-PP(2)-CP(2)-SP(2)-TP(2) rank 13"


def test_mesh_string_and_shard_index_without_a_process_group():
    mesh = Mesh(ParallelConfig(pp=2, sp=2, tp=2), rank=5, world_size=8)
    assert str(mesh) == "DP(1)-PP(2)-SP(2)-TP(2) rank 5"
    # rank 5 = (pp=1, sp=0, tp=1): head block j = tp*SP + sp = 2
    assert (mesh.coords.pp, mesh.coords.sp, mesh.coords.tp) == (1, 0, 1)
    assert mesh.shard_index == 2
    assert mesh.shift.ranks == (4, 5, 6, 7)
    assert mesh.is_last_stage and not mesh.is_first_stage


def _mesh_facts():
    mesh = Mesh(ParallelConfig(sp=2, tp=2))
    return mesh.shard_index, mesh.tp.ranks, mesh.sp.ranks, mesh.shift.size, mesh.dp_sp.ranks


def test_shard_indices_cover_the_shift_group_once(ranks):
    facts = ranks.run(4, _mesh_facts)
    assert sorted(f[0] for f in facts) == [0, 1, 2, 3]
    assert [f[0] for f in facts] == [0, 2, 1, 3]  # rank (sp, tp) -> tp*SP + sp
    assert facts[1][1] == (0, 1) and facts[1][2] == (1, 3) and facts[1][3] == 4
    assert facts[3][4] == (1, 3)


def test_bad_degrees_are_rejected_with_the_fix():
    with pytest.raises(ConfigError, match="tp must be a positive integer"):
        ParallelConfig(tp=0)
