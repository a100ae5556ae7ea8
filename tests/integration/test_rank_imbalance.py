"""The per-rank monitor's imbalance warning: silent while two ranks do equal work, fires once
rank 1 is made slower on purpose (tests/workers/slow_rank.py), through the real Trainer path."""

from __future__ import annotations

import pytest

from tests.helpers import ROOT, TINY_ARGS, metrics, torchrun

pytestmark = pytest.mark.slow
SLOW_FROM, STEPS, LOG_EVERY = 9, 16, 4
# The warning threshold this run sets: the slowed rank makes the others wait > 70 % of each step, while
# balanced windows stay far below. At the default 20 % a balanced window of 0.15 s steps warned in one CI
# run (22 %: rank 0 lost 34 ms per step to another process on this 2-core machine).
THRESHOLD = 0.5


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("imbalance") / "run"
    args = [*TINY_ARGS, "--output_dir", str(out), "--max_steps", str(STEPS), "--logging_steps", str(LOG_EVERY),
            "--per_device_train_batch_size", "16", "--comm_profile_steps", "0",
            "--imbalance_warn_threshold", str(THRESHOLD)]
    result = torchrun(2, ROOT / "tests" / "workers" / "slow_rank.py", [str(SLOW_FROM), "0.5", *args], timeout=400)
    assert result.returncode == 0, result.output[-6000:]
    records = {m["step"]: m for m in metrics(out) if "rank_stats" in m}
    return records, result


def test_one_record_per_logging_step_with_both_ranks(run):
    records, _ = run
    assert sorted(records) == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    for record in records.values():
        stats = record["rank_stats"]
        assert all(len(values) == 2 for values in stats.values())
        # per rank: compute is part of its step, its counted tensors are resident in its peak; replicas hold the same
        assert all(c <= s for c, s in zip(stats["compute_time_s"], stats["step_time_s"])), stats
        assert all(p >= t for p, t in zip(stats["peak_mem_mb"], stats["tensor_mb"])), stats
        assert stats["tensor_mb"][0] == stats["tensor_mb"][1], stats


def test_balanced_windows_do_not_warn(run):
    records, _ = run
    for step in (4, 8):
        assert records[step]["imbalance_warning"] is False, records[step]
        assert records[step]["rank_wait_share"] < THRESHOLD


def test_slowed_rank_is_named_in_the_warning(run):
    records, result = run
    for step in (12, 16):
        record = records[step]
        assert record["imbalance_warning"] is True and record["rank_wait_share"] > 0.7, record
        compute = record["rank_stats"]["compute_time_s"]
        assert compute[1] > compute[0] + 0.4  # rank 1 sleeps 0.5 s per step inside its forward
        # wall step times stay equal: rank 0 waits for rank 1 at the all-reduce
        wall = record["rank_stats"]["step_time_s"]
        assert abs(wall[0] - wall[1]) < 0.25 * max(wall)
    warnings = [line for line in result.output.splitlines() if "rank imbalance" in line]
    assert len(warnings) == 2 and all("rank 1 computes" in w for w in warnings), warnings
