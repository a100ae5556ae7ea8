"""Bytes on the wire and time in flight, counted inside the hooks, per optimizer step.

Bytes are *modelled*, not sniffed: each collective's payload times the factor of the
bandwidth-optimal algorithm for a group of ``n`` ranks (ring all-reduce, reduce-scatter based
reduce and broadcast, ring all-gather). The same model prices the uncompressed fp32 all-reduce
that DDP would otherwise run, so the ratio between the two is what a hook saves whatever the
backend's actual algorithm. Gloo and NCCL both pick bandwidth-optimal algorithms for large
messages, which is where these figures matter.

Hierarchical phases run on sub-groups: their factors use the sub-group's size, and the leaders'
all-reduce is also counted as inter-node bytes (only leaders send those).

Time is the union of the intervals during which at least one of the step's collectives was in
flight (issue -> completion callback): overlapping collectives are not counted twice. This is
wall time on gloo, whose futures complete when the data has arrived. NCCL futures complete once
the work is ordered on the device's stream, so there the same intervals measure enqueueing, not
transfer: they are logged under their own names (``comm_enqueue_time_s``, ``comm_enqueue_wait_s``)
and ``comm_time_s`` is absent: a GPU transfer time needs the profiler or Nsight.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence


def wire_bytes(op: str, payload_bytes: int, group_size: int) -> float:
    """Bytes one rank sends for ``op`` on ``payload_bytes`` (its own contribution) in a group of ``group_size``."""
    n = group_size
    if n <= 1:
        return 0.0
    factors = {
        "all_reduce": 2.0 * (n - 1) / n,
        "reduce": (n - 1) / n,
        "broadcast": (n - 1) / n,
        "all_gather": float(n - 1),
        "gather": (n - 1) / n,
        "all_to_all": 1.0,  # the payload given is what this rank addresses to the others (splits are uneven)
    }
    return factors[op] * payload_bytes


@dataclass
class StepCounters:
    """What one rank's hooks did during one optimizer step (or, summed, a logging window)."""

    bytes_sent: float = 0.0
    inter_node_bytes: float = 0.0
    fp32_allreduce_bytes: float = 0.0
    collectives: int = 0
    hook_calls: int = 0
    buckets: int = 0
    comm_time_s: float = 0.0
    hook_time_s: float = 0.0
    wait_time_s: float = 0.0  # a hook blocked on a collective (backward stalled meanwhile)

    def add(self, other: StepCounters) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class CommStats:
    """Per-rank counters the hooks write and the engine reads once per optimizer step.

    Hooks run on the autograd thread and their completion callbacks on the backend's thread,
    so every update holds a lock.
    """

    world_size: int
    arrival_timed: bool = True  # the backend's futures complete when the data has arrived (gloo; not NCCL)
    current: StepCounters = field(default_factory=StepCounters)
    window: StepCounters = field(default_factory=StepCounters)
    window_steps: int = 0
    total_steps: int = 0
    last_hook_end: float = 0.0  # perf_counter when the latest hook returned (backward's compute is done)
    _intervals: list[list[float]] = field(default_factory=list)
    _bucket_ids: set[int] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def begin_hook(self, bucket_index: int, bucket_bytes_fp32: int) -> float:
        """Called at the start of every hook: counts the bucket and prices its fp32 all-reduce."""
        with self._lock:
            self.current.hook_calls += 1
            self._bucket_ids.add(bucket_index)
            self.current.fp32_allreduce_bytes += wire_bytes("all_reduce", bucket_bytes_fp32, self.world_size)
        return time.perf_counter()

    def end_hook(self, started: float) -> None:
        now = time.perf_counter()
        with self._lock:
            self.current.hook_time_s += now - started
            self.last_hook_end = now

    def issued(self, op: str, payload_bytes: int, group_size: int, inter_node: bool = False) -> list[float]:
        """Record one collective; returns its interval, to be closed by :meth:`completed`."""
        sent = wire_bytes(op, payload_bytes, group_size)
        interval = [time.perf_counter(), float("nan")]
        with self._lock:
            self.current.collectives += 1
            self.current.bytes_sent += sent
            if inter_node:
                self.current.inter_node_bytes += sent
            self._intervals.append(interval)
        return interval

    def completed(self, interval: list[float]) -> None:
        with self._lock:
            interval[1] = time.perf_counter()

    def waited(self, started: float) -> None:
        """A hook blocked on a collective from ``started`` until now (this span counts as in flight too)."""
        now = time.perf_counter()
        with self._lock:
            self.current.wait_time_s += now - started
            self._intervals.append([started, now])

    def in_flight_since(self, since: float) -> float:
        """How long after ``since`` a collective of the current step was in flight.

        With ``since`` = :attr:`last_hook_end`, read when backward returns: the communication
        backward had to wait for, because no gradient computation was left to hide it.
        """
        with self._lock:
            late = [[max(start, since), end] for start, end in self._intervals if math.isnan(end) or end > since]
        return union_length(_ended_now(late))

    def end_step(self) -> StepCounters:
        """Close the optimizer step: returns its counters and adds them to the logging window."""
        with self._lock:
            step = self.current
            step.buckets = len(self._bucket_ids)
            step.comm_time_s = union_length(_ended_now(self._intervals))
            self.current = StepCounters()
            self._intervals = []
            self._bucket_ids = set()
            self.window.add(step)
            self.window_steps += 1
            self.total_steps += 1
        return step

    def pop_window(self) -> dict[str, Any]:
        """Per-step averages over the steps since the last call (what goes into a log line)."""
        with self._lock:
            window, steps = self.window, self.window_steps
            self.window, self.window_steps = StepCounters(), 0
        if steps == 0:
            return {}
        return log_fields(window, steps, self.arrival_timed)


def log_fields(counters: StepCounters, steps: int = 1, arrival_timed: bool = True) -> dict[str, Any]:
    """The metric names hftk logs for communication (per optimizer step, this rank); without
    ``arrival_timed`` the in-flight times are named for what they measure (enqueueing)."""
    per = {name: getattr(counters, name) / steps for name in counters.__dataclass_fields__}
    ratio = per["fp32_allreduce_bytes"] / per["bytes_sent"] if per["bytes_sent"] else float("nan")
    timed = "comm" if arrival_timed else "comm_enqueue"
    return {
        "comm_bytes_per_step": per["bytes_sent"],
        "comm_inter_node_bytes_per_step": per["inter_node_bytes"],
        "comm_fp32_allreduce_bytes_per_step": per["fp32_allreduce_bytes"],
        "comm_compression_ratio": ratio,
        "comm_collectives_per_step": per["collectives"],
        "comm_hook_calls_per_step": per["hook_calls"],
        "comm_buckets": per["buckets"],
        f"{timed}_time_s": per["comm_time_s"],
        "comm_hook_time_s": per["hook_time_s"],
        f"{timed}_wait_s": per["wait_time_s"],
    }


def union_length(intervals: Iterable[Sequence[float]]) -> float:
    """Total length covered by ``(start, end)`` intervals, overlaps counted once (collectives in
    flight together here; gloo / NCCL events on several threads in :mod:`hftk.telemetry.rank_monitor`)."""
    total, covered_until = 0.0, -math.inf
    for start, end in sorted(tuple(i) for i in intervals):
        if end > covered_until:
            total += end - max(start, covered_until)
            covered_until = end
    return total


def _ended_now(intervals: list[list[float]]) -> list[tuple[float, float]]:
    """An interval still in flight (end NaN) ends now."""
    now = time.perf_counter()
    return [(start, now if math.isnan(end) else end) for start, end in intervals]
