"""Hierarchical all-reduce: reduce inside a node, all-reduce among node leaders, broadcast back.

Only one rank per node puts bytes on the slow inter-node link, and it sends one node's worth
instead of each rank's. Nodes come from the launcher (torchrun sets ``GROUP_RANK``, the node's
index, and ``LOCAL_WORLD_SIZE``); every rank learns every other rank's node through one
all-gather, then builds the same groups in the same order (``new_group`` is collective over
the whole world, whoever ends up a member).

The three phases depend on each other and run on different process groups, which gloo serves
from different threads, so each phase waits for the previous one inside the hook: the whole
all-reduce is issued from the autograd thread, in bucket order, on every rank. The result is
returned as an already completed future.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from hftk.comm.accounting import CommStats
from hftk.comm.collectives import completed_future, gather_objects


@dataclass(frozen=True)
class Topology:
    nodes: tuple[tuple[int, ...], ...]  # global ranks of each node, nodes ordered by GROUP_RANK
    node_index: int  # which node this rank is on
    local_index: int  # this rank's position inside its node (0 = the node's leader)

    @property
    def is_leader(self) -> bool:
        return self.local_index == 0


def discover_topology() -> Topology:
    """Every rank's node from ``GROUP_RANK``; nodes must be the same size (all-gather needs it)."""
    node_id = int(os.environ["GROUP_RANK"])
    ids = gather_objects(node_id)
    nodes = tuple(tuple(r for r, n in enumerate(ids) if n == node) for node in sorted(set(ids)))
    sizes = {len(node) for node in nodes}
    if len(sizes) != 1:
        raise RuntimeError(f"hierarchical all-reduce needs the same number of ranks on every node, got {sizes}")
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", len(nodes[0])))
    if local_size != len(nodes[0]):
        raise RuntimeError(f"LOCAL_WORLD_SIZE={local_size} but {len(nodes[0])} ranks share GROUP_RANK {node_id}")
    rank = dist.get_rank()
    node_index = next(i for i, node in enumerate(nodes) if rank in node)
    return Topology(nodes=nodes, node_index=node_index, local_index=nodes[node_index].index(rank))


class HierarchicalComm:
    """Same interface as :class:`hftk.comm.collectives.FlatComm`, over intra-node + leader groups."""

    def __init__(self, stats: CommStats, topology: Topology) -> None:
        self.stats = stats
        self.topology = topology
        self.size = dist.get_world_size()
        intra_groups = [dist.new_group(list(node)) for node in topology.nodes]  # every rank, same order
        self.intra = intra_groups[topology.node_index]
        self.inter = dist.new_group([node[0] for node in topology.nodes])
        self.node_size = len(topology.nodes[0])
        self.num_nodes = len(topology.nodes)

    def all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        nbytes = tensor.numel() * tensor.element_size()
        if self.node_size > 1:
            self._sync("reduce", nbytes, self.node_size, False,
                       lambda: dist.reduce(tensor, group=self.intra, group_dst=0, async_op=True))
        if self.topology.is_leader and self.num_nodes > 1:
            self._sync("all_reduce", nbytes, self.num_nodes, True,
                       lambda: dist.all_reduce(tensor, group=self.inter, async_op=True))
        if self.node_size > 1:
            self._sync("broadcast", nbytes, self.node_size, False,
                       lambda: dist.broadcast(tensor, group=self.intra, group_src=0, async_op=True))
        return completed_future(tensor)

    def all_gather(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Every rank's ``tensor`` concatenated node by node (rank order when nodes hold consecutive ranks)."""
        tensor = tensor.contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        node_buf = tensor.new_empty(self.node_size * tensor.numel())
        out = tensor.new_empty(self.size * tensor.numel())
        if self.node_size > 1:
            chunks = list(node_buf.chunk(self.node_size)) if self.topology.is_leader else None
            self._sync("gather", nbytes, self.node_size, False,
                       lambda: dist.gather(tensor, chunks, group=self.intra, group_dst=0, async_op=True))
        else:
            node_buf.copy_(tensor)
        if self.topology.is_leader:
            if self.num_nodes > 1:
                self._sync("all_gather", nbytes * self.node_size, self.num_nodes, True,
                           lambda: dist.all_gather_single(out, node_buf, group=self.inter, async_op=True))
            else:
                out.copy_(node_buf)
        if self.node_size > 1:
            self._sync("broadcast", nbytes * self.size, self.node_size, False,
                       lambda: dist.broadcast(out, group=self.intra, group_src=0, async_op=True))
        return completed_future(out)

    def _sync(self, op: str, nbytes: int, group_size: int, inter_node: bool, issue: Callable[[], Any]) -> None:
        interval = self.stats.issued(op, nbytes, group_size, inter_node=inter_node)
        issue().wait()
        self.stats.completed(interval)
        self.stats.waited(interval[0])
