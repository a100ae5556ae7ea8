"""PowerSGD (Vogels et al., 2019): rank-r gradient approximation with error feedback and warm start.

For each matrix gradient M (plus its carried error), with Q the previous step's factor:
P = M Q, all-reduce P, orthogonalise P, Q = M^T P, all-reduce Q, approximation P Q^T / world.
Vectors (biases, norms) and matrices too small to gain go uncompressed, in the same all-reduce
as P. Two collectives per bucket instead of torch's hook's chain of futures: the P all-reduce is
waited for inside the hook and the Q all-reduce is issued from the hook too, so all ranks issue
the same collectives in the same order whatever the bucket count (torch's hook issues the Q
all-reduce from the P future's callback, on gloo's thread, and hangs with many buckets).
The first ``powersgd_warmup_steps`` steps are plain all-reduces (PowerSGD needs a trained
direction to start from).
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import torch

from hftk.comm.hooks import HookState, average, bucket_slices

MIN_COMPRESSION_RATE = 2.0  # compress a matrix only when it shrinks at least this much


def _compressible(grad: torch.Tensor, rank: int) -> tuple[int, int, int] | None:
    """(rows, cols, effective rank) when this gradient gains from compression, else None."""
    if grad.ndim < 2:
        return None
    rows, cols = grad.shape[0], grad.numel() // grad.shape[0]
    r = min(rank, rows, cols)
    if rows * cols < MIN_COMPRESSION_RATE * r * (rows + cols):
        return None
    return rows, cols, r


def initial_q(name: str, cols: int, rank: int, device: torch.device) -> torch.Tensor:
    """A random start for Q, identical on every rank (seeded from the parameter's name)."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(cols, rank, generator=generator).to(device)


def powersgd_average(state: HookState, bucket: Any) -> torch.futures.Future:
    """Average a bucket through its rank-``powersgd_rank`` approximation (see the module docstring)."""
    if state.step < state.powersgd_warmup_steps:
        return average(state, bucket)
    buffer = bucket.buffer()
    world = state.comm.size
    matrices, vectors = [], []
    for name, where, grad in bucket_slices(state, bucket):
        shape = _compressible(grad, state.powersgd_rank)
        if shape is None:
            vectors.append(where)
            continue
        rows, cols, r = shape
        m = grad.reshape(rows, cols).float()
        m = m + state.error[name] if name in state.error else m.clone()
        q = state.q.get(name)
        if q is None:
            q = initial_q(name, cols, r, buffer.device)
        matrices.append((name, grad, m, q))
    if not matrices:
        return average(state, bucket)

    uncompressed = [buffer[where].float().div(world) for where in vectors]
    ps = [m @ q for _, _, m, q in matrices]
    first = torch.cat([*(u.flatten() for u in uncompressed), *(p.flatten() for p in ps)])
    started = time.perf_counter()
    first = state.comm.all_reduce(first).wait()  # P must be summed before Q can be computed
    state.stats.waited(started)

    offset = 0
    for where, u in zip(vectors, uncompressed):
        buffer[where].copy_(first[offset:offset + u.numel()])
        offset += u.numel()
    qs = []
    for (_, _, m, _), p in zip(matrices, ps):
        p_sum = first[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
        p_orth = torch.linalg.qr(p_sum).Q
        qs.append((p_orth, m.t() @ p_orth))

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        q_flat = fut.value().div_(world)
        start = 0
        for (name, grad, m, _), (p_orth, q) in zip(matrices, qs):
            q_avg = q_flat[start:start + q.numel()].view_as(q)
            start += q.numel()
            approx = p_orth @ q_avg.t()
            state.error[name] = m - approx
            state.q[name] = q_avg.clone()
            grad.copy_(approx.view_as(grad))
        return buffer

    second = torch.cat([q.flatten() for _, q in qs])
    return state.comm.all_reduce(second).then(decompress)
