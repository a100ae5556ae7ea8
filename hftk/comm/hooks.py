"""hftk's DDP communication hooks: plain all-reduce, fp16, bf16 and top-k with error feedback.

A hook is ``hook(state, bucket) -> Future[Tensor]`` (DDP calls it once per gradient bucket, in
bucket order, on the autograd thread). DDP does not divide by the world size: every hook
returns the *average*. Rules every hook here keeps, because breaking them hangs gloo:

- every collective is issued from the hook itself, never from a future's callback, so all
  ranks issue them in the same order whatever the bucket count;
- a bucket's collectives have the same sizes on every rank (top-k's k depends only on the
  sizes of the bucket's parameters);
- the result is bitwise identical on every rank, so replicas never drift.

Per-parameter state (error feedback, PowerSGD's Q) is keyed by parameter name, not bucket
index: DDP rebuilds its buckets after the first step, and a resumed run may use another
bucket size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from hftk.comm.accounting import CommStats


@dataclass
class HookState:
    """Everything a hook keeps between calls on one rank."""

    kind: str  # "allreduce", "fp16", "bf16", "powersgd" or "topk"
    comm: Any  # FlatComm or HierarchicalComm
    stats: CommStats
    names: dict[int, str]  # id(parameter) -> its name in the model
    powersgd_rank: int = 4
    powersgd_warmup_steps: int = 10
    topk_ratio: float = 0.01
    topk_warmup_steps: int = 10
    step: int = 0  # synchronised backward passes so far (= optimizer steps)
    error: dict[str, torch.Tensor] = field(default_factory=dict)  # error feedback, per parameter
    q: dict[str, torch.Tensor] = field(default_factory=dict)  # PowerSGD warm-start factors


def bucket_slices(state: HookState, bucket: Any) -> Iterator[tuple[str, slice, torch.Tensor]]:
    """(parameter name, its slice of the flat bucket buffer, its gradient view) for each parameter."""
    base = bucket.buffer().storage_offset()
    for param, grad in zip(bucket.parameters(), bucket.gradients()):
        start = grad.storage_offset() - base
        yield state.names[id(param)], slice(start, start + grad.numel()), grad


def timed(hook: Callable[[HookState, Any], torch.futures.Future]) -> Callable[[HookState, Any], torch.futures.Future]:
    """Counts the bucket, prices its fp32 all-reduce, times the hook, advances the step after the last bucket."""

    # No annotations on purpose: DDP checks them, and this module's are strings (PEP 563).
    def wrapper(state, bucket):  # type: ignore[no-untyped-def]
        buffer = bucket.buffer()
        started = state.stats.begin_hook(bucket.index(), buffer.numel() * 4)
        fut = hook(state, bucket)
        state.stats.end_hook(started)
        if bucket.is_last():
            state.step += 1
        return fut

    wrapper.__name__ = hook.__name__
    wrapper.__doc__ = hook.__doc__
    return wrapper


def average(state: HookState, bucket: Any) -> torch.futures.Future:
    """Uncompressed all-reduce of the bucket (what DDP does by default), through hftk's communicator."""
    buffer = bucket.buffer()
    buffer.div_(state.comm.size)
    return state.comm.all_reduce(buffer)


def cast_average(dtype: torch.dtype) -> Callable[[HookState, Any], torch.futures.Future]:
    """All-reduce in ``dtype`` (half the bytes of fp32); divided first so fp16 does not overflow."""

    def hook(state: HookState, bucket: Any) -> torch.futures.Future:
        buffer = bucket.buffer()
        compressed = buffer.div(state.comm.size).to(dtype)
        return state.comm.all_reduce(compressed).then(lambda fut: buffer.copy_(fut.value()))

    hook.__name__ = f"{str(dtype).removeprefix('torch.')}_average"
    return hook


def topk_average(state: HookState, bucket: Any) -> torch.futures.Future:
    """Each rank sends, per parameter, its largest-magnitude ``topk_ratio`` of (gradient + carried error).

    Selection is per parameter, not over the whole bucket: a bucket-wide top-k starves the
    tensors whose gradients are small in absolute terms (norms, deep layers) and trains worse.
    Values (fp32) and bucket offsets (int32) of every parameter travel packed in ONE all-gather;
    what was not sent is kept as error feedback and added to the next step's gradient. Every
    rank sums the gathered entries rank by rank, so all replicas get bitwise the same average.
    The first ``topk_warmup_steps`` steps are plain all-reduces.
    """
    if state.step < state.topk_warmup_steps:
        return average(state, bucket)
    buffer = bucket.buffer()
    numel = buffer.numel()
    if numel >= 2**31:
        raise RuntimeError(f"top-k packs int32 indices; bucket {bucket.index()} has {numel} elements")
    corrected = buffer.float()
    if corrected.data_ptr() == buffer.data_ptr():
        corrected = corrected.clone()
    picked = []
    for name, where, _ in bucket_slices(state, bucket):
        part = corrected[where]
        if name in state.error:
            part += state.error[name]
        k = max(1, math.ceil(state.topk_ratio * part.numel()))
        picked.append(part.abs().topk(k, sorted=False).indices + where.start)
        state.error[name] = part  # a view: zeroing the sent entries below leaves this rank's error
    indices = torch.cat(picked)
    values = corrected[indices]
    corrected[indices] = 0.0
    packed = torch.cat([values.view(torch.int32), indices.to(torch.int32)])
    world, k = state.comm.size, indices.numel()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        gathered = fut.value().view(world, 2, k)
        dense = torch.zeros(numel, dtype=torch.float32, device=buffer.device)
        for rank in range(world):  # fixed order: every rank adds in the same sequence
            idx = gathered[rank, 1].long()
            dense[idx] = dense[idx] + gathered[rank, 0].view(torch.float32)
        return buffer.copy_(dense.div_(world))

    return state.comm.all_gather(packed).then(decompress)
