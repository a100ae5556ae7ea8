"""hftk/strategies/parallel_dims.py: every strategy's degrees over a world size, checked once, and the meshes
built from them."""

from __future__ import annotations

import pytest

from hftk.config.options import load_config
from hftk.core.errors import HftkError
from hftk.strategies.parallel_dims import MESH_LOOP_DIMS, ParallelDims, check_experts, parallel_dims
from tests.helpers import TINY_ARGS


def dims_of(tmp_path, world: int, *args: str) -> ParallelDims:
    return parallel_dims(load_config([*TINY_ARGS, *args, "--output_dir", str(tmp_path)]).strategy, world)


@pytest.mark.parametrize("args, world, expected, readers", [
    ([], 4, ParallelDims(dp_replicate=4), 4),
    (["--strategy", "fsdp"], 4, ParallelDims(dp_shard=4), 4),
    (["--strategy", "zero3"], 2, ParallelDims(dp_shard=2), 2),
    (["--strategy", "pipeline", "--pp_size", "2"], 4, ParallelDims(dp_replicate=2, pp=2), 2),
    (["--strategy", "sp", "--sp_size", "2"], 4, ParallelDims(dp_replicate=2, sp=2), 2),
    (["--strategy", "tp", "--tp_size", "2", "--dp_shard_size", "-1"], 8, ParallelDims(dp_shard=4, tp=2), 4),
    (["--strategy", "cp", "--cp_size", "2", "--tp_size", "2", "--dp_replicate_size", "2"], 8,
     ParallelDims(dp_replicate=2, cp=2, tp=2), 2),
    (["--strategy", "ep"], 4, ParallelDims(dp_shard=4, ep=4), 4),  # ep borrows its ranks from the data-parallel shards
    (["--strategy", "ep", "--ep_size", "2"], 4, ParallelDims(dp_shard=4, ep=2), 4),
])
def test_each_strategy_divides_the_world(tmp_path, args, world, expected, readers):
    dims = dims_of(tmp_path, world, *args)
    assert dims == expected and dims.world_size == world and dims.data_parallel == readers


@pytest.mark.parametrize("args, world, message", [
    (["--strategy", "pipeline", "--pp_size", "2"], 3,
     "strategy.pp_size: the world size 3 is not a multiple of pp_size 2. Fix: launch a multiple of 2 processes"),
    (["--strategy", "sp", "--sp_size", "2"], 3, "strategy.sp_size: 2 does not divide the world size 3."),
    (["--strategy", "tp", "--tp_size", "2"], 4, "strategy.tp_size: dp_replicate_size 1 x dp_shard_size 1 x cp_size 1 "
                                                "x tp_size 2 = 2 ranks, but the world size is 4."),
    (["--strategy", "cp", "--cp_size", "3", "--dp_shard_size", "-1"], 4,
     "strategy.cp_size: tp_size 1 x cp_size 3 x dp_replicate_size 1 does not divide the world size 4."),
    (["--strategy", "ep", "--ep_size", "3"], 4, "strategy.ep_size: 3 does not divide the world size 4."),
])
def test_a_world_the_degrees_do_not_fit_is_refused_by_name(tmp_path, args, world, message):
    with pytest.raises(HftkError) as caught:
        dims_of(tmp_path, world, *args)
    assert caught.value.one_line().startswith(message), caught.value.one_line()


def test_expert_parallel_splits_the_experts_evenly_or_names_the_degrees_that_do():
    dims = ParallelDims(dp_shard=8, ep=4)
    assert dims.dp_shard_mod_ep == 2  # each expert on 2 ranks (FSDP2 between them)
    check_experts(dims, 8)
    with pytest.raises(HftkError) as caught:
        check_experts(dims, 6)
    assert caught.value.one_line() == ("strategy.ep_size: 4 does not divide the model's 6 experts per layer. Fix: "
                                       "choose an ep_size that divides both 6 and the world size 8: 1, 2.")


def test_the_mesh_has_the_degrees_in_the_named_order():
    """Built over torch's fake process group: 8 ranks in one process, this one rank 5."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=5, world_size=8, store=FakeStore())
    try:
        mesh = ParallelDims(dp_replicate=2, cp=2, tp=2).mesh("cpu", MESH_LOOP_DIMS)
        assert mesh.mesh_dim_names == MESH_LOOP_DIMS and tuple(mesh.shape) == (2, 1, 2, 2)
        # rank 5 = (1, 0, 0, 1) in row-major order: tp is the innermost (neighbouring ranks)
        assert [mesh.get_local_rank(n) for n in MESH_LOOP_DIMS] == [1, 0, 0, 1]
    finally:
        dist.destroy_process_group()


def test_the_expert_parallel_mesh_groups_neighbouring_ranks_into_ep_groups():
    """``(dp_shard_mod_ep, ep, tp)`` over 8 fake ranks with ep 4: rank 5 holds the second quarter of the experts, in
    the second pair of ranks that hold the same experts; ``dp_shard`` flattens the first two (every rank's rows)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hftk.strategies.expert import _mesh

    dist.init_process_group("fake", rank=5, world_size=8, store=FakeStore())
    try:
        mesh, dp_shard = _mesh(ParallelDims(dp_shard=8, ep=4), "cpu")
        assert tuple(mesh.shape) == (2, 4, 1) and [mesh.get_local_rank(n) for n in mesh.mesh_dim_names] == [1, 1, 0]
        assert dp_shard.size() == 8 and dp_shard.get_local_rank() == 5
    finally:
        dist.destroy_process_group()
