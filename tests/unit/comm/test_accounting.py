"""Communication accounting (hftk.comm.accounting): the wire-byte model, overlapping collectives counted once."""

from __future__ import annotations

import math
import time

import pytest

from hftk.comm.accounting import CommStats, union_length, wire_bytes


def test_wire_bytes_model():
    assert wire_bytes("all_reduce", 1000, 2) == 1000
    assert wire_bytes("all_reduce", 1000, 4) == 1500
    assert wire_bytes("all_gather", 1000, 4) == 3000
    assert wire_bytes("reduce", 1000, 1) == 0
    assert wire_bytes("all_to_all", 1000, 4) == 1000  # what the rank addresses to the others, as given


def test_comm_time_counts_overlapping_collectives_once():
    assert union_length([[0.0, 2.0], [1.0, 3.0], [5.0, 6.0]]) == pytest.approx(4.0)
    stats = CommStats(world_size=2)
    stats.begin_hook(0, 400)
    interval = stats.issued("all_reduce", 200, 2)
    stats.completed(interval)
    stats.waited(time.perf_counter() - 0.5)  # a hook blocked half a second on a collective
    step = stats.end_step()
    assert (step.bytes_sent, step.fp32_allreduce_bytes, step.collectives, step.buckets) == (200, 400, 1, 1)
    assert step.wait_time_s == pytest.approx(0.5, abs=0.05) and step.comm_time_s >= step.wait_time_s
    stats._intervals = [[10.0, 12.0], [11.0, 13.0]]  # two overlapping collectives, backward's compute ended at 11.5
    assert stats.in_flight_since(11.5) == pytest.approx(1.5)
    stats._intervals = []
    window = stats.pop_window()
    assert window["comm_compression_ratio"] == 2.0 and not math.isnan(window["comm_time_s"])


def test_a_strategys_own_collectives_reach_each_logged_step_per_optimizer_step():
    """Expert parallel's all-to-alls (hftk.comm.callback.StepCommCallback): a logging window of two steps logs their
    mean bytes and count; a log line without a training loss (evaluation) gets nothing."""
    from hftk.comm.callback import StepCommCallback

    stats = CommStats(world_size=2)
    callback = StepCommCallback(stats, "ep_all_to_all")
    for payload in (100, 300):
        stats.completed(stats.issued("all_to_all", payload, 2))
        stats.completed(stats.issued("all_to_all", payload, 2))
        callback.on_step_end(None, None, None)
    evaluation = {"eval_loss": 1.0}
    callback.on_log(None, None, None, logs=evaluation)
    logs = {"loss": 1.0}
    callback.on_log(None, None, None, logs=logs)
    assert evaluation == {"eval_loss": 1.0}
    assert logs == {"loss": 1.0, "ep_all_to_all_bytes_per_step": 400.0, "ep_all_to_all_per_step": 2.0}
