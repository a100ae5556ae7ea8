"""The comm bench's summary (hftk.bench.comm) of logged collective intervals."""

from __future__ import annotations

from hftk.comm.accounting import CommStats


def test_nccl_intervals_are_logged_as_enqueue_times_and_the_bench_leaves_comm_shares_empty():
    """NCCL futures complete on enqueue: their intervals must not pass for transfer times."""
    from hftk.bench.comm import summarise, table

    stats = CommStats(world_size=2, arrival_timed=False)
    stats.completed(stats.issued("all_reduce", 200, 2))
    stats.end_step()
    window = stats.pop_window()
    assert "comm_time_s" not in window and "comm_wait_s" not in window
    assert window["comm_enqueue_time_s"] >= 0 and "comm_enqueue_wait_s" in window
    records = [{"loss": 1.0, "wall_s": 0.5, "cpu_s": 0.4, **window} for _ in range(3)]
    summary = summarise({"records": records, "eval_loss": 1.0}, first_timed=1)
    assert summary["comm_share"] is None and summary["exposed_comm_share"] is None
    rendered = table({"hooks": {"none": summary}, "loadavg_before": [0.0], "loadavg_after": [0.0], "model": "m",
                      "params": 1e6, "nproc": 2, "timed_steps": 2, "steps": 3, "machine": {"device": "cuda"}})
    assert rendered["rows"][0][2:4] == ["-", "-"] and "NCCL futures complete on enqueue" in rendered["title"]
