"""The pipeline bench's bubble (hftk/bench/pipeline.py): a replay of a schedule's trace recovers the
theory, and the wall-clock bubble counts idle time."""

from __future__ import annotations

import pytest


def _gpipe_trace(p: int, m: int, f: float, b: float) -> list[list[list]]:
    """What torch's GPipe runs on each rank: all forwards, then all backwards, micro-batch order."""
    return [[["F", r, i, 0, 0, f] for i in range(m)] + [["B", r, i, 0, 0, b] for i in range(m)] for r in range(p)]


def test_bench_replay_recovers_theory_and_wall_counts_idle():
    from hftk.bench.pipeline import replay, theory, wall_bubble

    for p, m in ((2, 1), (2, 4), (4, 8)):
        assert replay(_gpipe_trace(p, m, 1.0, 2.0), p) == pytest.approx(theory("gpipe", m, p, 1))
    assert theory("interleaved_1f1b", 4, 2, 2) == pytest.approx(1 / 9)
    assert theory("interleaved_1f1b", 1, 2, 2) == pytest.approx(0.5)  # one micro-batch cannot overlap its chunks
    # the loss is charged to the last stage's forward: 1 + 0.5 per micro-batch there
    trace = _gpipe_trace(2, 2, 1.0, 2.0)
    trace[1][1:1] = [["L", 1, 0, 0, 0, 0.5]]
    trace[1][3:3] = [["L", 1, 1, 0, 0, 0.5]]
    assert replay(trace, 2) == pytest.approx(1 - (6 + 7) / (2 * 10.0))  # makespan 1 + 2 x 1.5 + 2 x 2 + 2
    steps = [{"start": 0.0, "end": 10.0, "events": [["F", 0, 0, 0.0, 4.0, 4.0]]},
             {"start": 0.0, "end": 10.0, "events": [["F", 1, 0, 4.0, 10.0, 6.0]]}]
    assert wall_bubble(steps) == pytest.approx(0.5)
