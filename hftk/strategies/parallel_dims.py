"""Leaf: how one run's ranks divide, ``dp_replicate x dp_shard x cp x tp x pp x sp = world size``,
resolved and checked once (torchtitan's ``ParallelDims``).

Every strategy reads its degrees here: tp / cp / sp's meshes, the pipeline's ``(dp, pp)`` mesh,
Ulysses' ``(dp, sp)`` mesh, expert parallel's ``(dp_shard_mod_ep, ep)`` mesh, and the global batch a resume at
another world size must keep (:attr:`ParallelDims.data_parallel`, the ranks that read different samples).

Expert parallel is not a factor of the world size of its own: as in torchtitan, the ``ep`` ranks that split a
layer's experts are borrowed from the data-parallel shards (they read different samples and shard the dense
parts with FSDP2), so ``ep`` divides ``dp_shard`` and the experts' own FSDP2 runs over the ``dp_shard / ep``
ranks that hold the same experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hftk.core.errors import HftkError

MESH_LOOP_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")  # tp innermost: its ranks are neighbours


@dataclass(frozen=True)
class ParallelDims:
    """The degree of every dimension; their product is the world size."""

    dp_replicate: int = 1  # copies of the model that read different samples (DDP, HSDP's replicas)
    dp_shard: int = 1  # FSDP2 / ZeRO shards that read different samples
    cp: int = 1  # ring-attention context parallel: one sequence over cp ranks
    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline stages
    sp: int = 1  # Ulysses sequence parallel: one sequence over sp ranks
    ep: int = 1  # expert parallel: each MoE layer's experts split over ep of the dp_shard ranks (not a factor)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp * self.sp

    @property
    def data_parallel(self) -> int:
        """Ranks that read different samples: the global batch is this times the per-rank batch."""
        return self.dp_replicate * self.dp_shard

    def mesh(self, device_type: str, names: tuple[str, ...]) -> Any:
        """Collective: the device mesh over ``names`` (in that order), every rank in it."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, tuple(getattr(self, n) for n in names), mesh_dim_names=names)

    @property
    def dp_shard_mod_ep(self) -> int:
        """Ranks that hold the same experts (their FSDP2 group) under expert parallel."""
        return self.dp_shard // self.ep


def check_experts(dims: ParallelDims, num_experts: int) -> None:
    """Expert parallel splits every MoE layer's ``num_experts`` evenly over ``dims.ep`` ranks, or says which to pick."""
    if num_experts % dims.ep:
        fits = [n for n in range(1, dims.dp_shard + 1) if dims.dp_shard % n == 0 and num_experts % n == 0]
        raise HftkError("strategy.ep_size", f"{dims.ep} does not divide the model's {num_experts} experts per layer.",
                        f"choose an ep_size that divides both {num_experts} and the world size {dims.dp_shard}: "
                        f"{', '.join(map(str, fits))}.")


def parallel_dims(strategy: Any, world_size: int) -> ParallelDims:
    """``strategy`` (a ``StrategyConfig``) over ``world_size`` ranks, or one line naming the degree to fix."""
    name = strategy.strategy
    if name in ("tp", "cp"):
        return _mesh_dims(strategy, world_size)
    if name == "sp":
        if strategy.sp_size < 1 or world_size % strategy.sp_size:
            raise HftkError("strategy.sp_size", f"{strategy.sp_size} does not divide the world size {world_size}.",
                            "choose an sp_size that divides the number of processes (the rest is data parallel).")
        return ParallelDims(dp_replicate=world_size // strategy.sp_size, sp=strategy.sp_size)
    if name == "pipeline":
        if strategy.pp_size < 2:
            raise HftkError("strategy.pp_size", f"pipeline needs at least 2 stages, got {strategy.pp_size}.",
                            "set --pp_size 2 or more (or use --strategy ddp for one stage).")
        if world_size % strategy.pp_size:
            raise HftkError("strategy.pp_size", f"the world size {world_size} is not a multiple of pp_size "
                            f"{strategy.pp_size}.",
                            f"launch a multiple of {strategy.pp_size} processes (pp_size x data-parallel replicas).")
        return ParallelDims(dp_replicate=world_size // strategy.pp_size, pp=strategy.pp_size)
    if name == "ep":
        ep = world_size if strategy.ep_size == -1 else strategy.ep_size
        if ep < 1 or world_size % ep:
            raise HftkError("strategy.ep_size", f"{strategy.ep_size} does not divide the world size {world_size}.",
                            "choose an ep_size that divides the number of processes (-1: all of them); the ranks "
                            "it leaves shard the same experts with FSDP2.")
        return ParallelDims(dp_shard=world_size, ep=ep)
    if name == "ddp":
        return ParallelDims(dp_replicate=world_size)
    return ParallelDims(dp_shard=world_size)  # fsdp and ZeRO shard over every rank (HSDP's split is theirs)


def _mesh_dims(s: Any, world_size: int) -> ParallelDims:
    """tp / cp: ``dp_shard_size -1`` takes whatever the other degrees leave."""
    for name in ("tp_size", "cp_size", "dp_replicate_size"):
        if getattr(s, name) < 1:
            raise HftkError(f"strategy.{name}", f"must be 1 or more, got {getattr(s, name)}.",
                            f"set strategy.{name} to 1 or more.")
    if s.dp_shard_size == 0 or s.dp_shard_size < -1:
        raise HftkError("strategy.dp_shard_size", f"must be -1 or 1 or more, got {s.dp_shard_size}.",
                        "use -1 (the rest of the world) or a positive degree.")
    field = "strategy.cp_size" if s.strategy == "cp" else "strategy.tp_size"
    shard = s.dp_shard_size
    if shard == -1:
        rest = s.tp_size * s.cp_size * s.dp_replicate_size
        if world_size % rest:
            raise HftkError(field, f"tp_size {s.tp_size} x cp_size {s.cp_size} x dp_replicate_size "
                            f"{s.dp_replicate_size} does not divide the world size {world_size}.",
                            "choose sizes whose product divides the world size.")
        shard = world_size // rest
    shape = (s.dp_replicate_size, shard, s.cp_size, s.tp_size)
    if math.prod(shape) != world_size:
        raise HftkError(field, f"dp_replicate_size {shape[0]} x dp_shard_size {shape[1]} x cp_size {shape[2]} x "
                        f"tp_size {shape[3]} = {math.prod(shape)} ranks, but the world size is {world_size}.",
                        f"make them multiply to {world_size} (dp_shard_size -1 fills in the rest).")
    return ParallelDims(dp_replicate=shape[0], dp_shard=shape[1], cp=shape[2], tp=shape[3])
