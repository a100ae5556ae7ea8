"""The two collectives hftk's hooks need, over one flat process group, with accounting.

A communicator is any object with ``size``, ``all_reduce(t)`` and ``all_gather(t)`` returning a
``torch.futures.Future`` whose value is the result tensor; :class:`FlatComm` is this one and
:class:`hftk.comm.hierarchical.HierarchicalComm` the node-aware one, so every hook runs over
either. Completion callbacks here only stop a clock: a collective issued inside a future's
callback runs on the backend's thread, in an order that differs between ranks (the hang that
torch's PowerSGD hook hits on gloo).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hftk.comm.accounting import CommStats

BUCKET_BYTES = 25 * 2**20  # flat all-reduce buckets: DDP's default bucket_cap_mb


def all_reduce_flat(tensors: list[torch.Tensor], group: Any, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum ``tensors`` in place over ``group`` in flat buckets of at most ``bucket_bytes`` (a larger
    tensor goes alone) instead of one call per tensor: the gradient reduction of the loops that
    reduce by hand (pipeline replicas, sequence parallel)."""
    start = 0
    while start < len(tensors):
        end, size = start, 0
        while end < len(tensors) and (end == start or size + _nbytes(tensors[end]) <= bucket_bytes):
            size += _nbytes(tensors[end])
            end += 1
        bucket = tensors[start:end]
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.all_reduce(flat, group=group)
        for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
            t.copy_(part.view_as(t))
        start = end


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def completed_future(value: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


class FlatComm:
    """Sum-all-reduce and all-gather over ``group`` (the default group when None), asynchronous."""

    def __init__(self, stats: CommStats, group: Any = None) -> None:
        self.stats = stats
        self.group = group
        self.size = dist.get_world_size(group)

    def all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        interval = self.stats.issued("all_reduce", tensor.numel() * tensor.element_size(), self.size)
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        return work.get_future().then(lambda _: self._done(interval, tensor))

    def all_gather(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Every rank's ``tensor`` concatenated in rank order (one flat tensor)."""
        out = tensor.new_empty(self.size * tensor.numel())
        interval = self.stats.issued("all_gather", tensor.numel() * tensor.element_size(), self.size)
        work = dist.all_gather_single(out, tensor.contiguous(), group=self.group, async_op=True)
        return work.get_future().then(lambda _: self._done(interval, out))

    def _done(self, interval: list[float], result: torch.Tensor) -> torch.Tensor:
        self.stats.completed(interval)
        return result


def gather_objects(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value`` (any picklable object), in rank order, on every rank; ``[value]`` when
    no process group is up."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out
