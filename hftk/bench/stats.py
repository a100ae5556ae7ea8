"""Robust summaries of noisy timings: medians with their spread, per-step series across ranks.

Wall-clock on a shared CPU machine varies by 10-20 % between runs (field notes), so every bench
quotes medians with min/max over repeats, never a single sample.
"""

from __future__ import annotations

import math
import statistics
from typing import Any


def spread(values: list[float]) -> dict[str, float]:
    """Median, min, max and count of ``values`` (at least one)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def percent(s: dict[str, float] | None) -> dict[str, float] | None:
    """A spread of fractions in percent (None stays None)."""
    return None if s is None else {key: value if key == "n" else 100 * value for key, value in s.items()}


def timed_steps(ranks: list[dict[str, Any]], warmup: int) -> list[dict[str, float]]:
    """Per optimizer step after ``warmup``: wall time of the slowest rank (it sets the pace of a synchronous
    run), CPU time averaged over ranks (each rank's own work)."""
    counts = {len(r["steps"]) for r in ranks}
    if len(counts) != 1:
        raise RuntimeError(f"ranks recorded different step counts: {sorted(counts)}")
    n = counts.pop()
    if n <= warmup:
        raise RuntimeError(f"only {n} steps recorded, not more than the {warmup} warm-up steps")
    return [{"wall_s": max(r["steps"][i]["wall_s"] for r in ranks),
             "cpu_s": sum(r["steps"][i]["cpu_s"] for r in ranks) / len(ranks)} for i in range(warmup, n)]


def median_of(steps: list[dict[str, float]], key: str) -> float:
    return statistics.median(s[key] for s in steps)


def timed_run(launch: Any, warmup: int, samples_per_step: int) -> dict[str, Any]:
    """One launch's (a :class:`hftk.bench.launch.LaunchResult`) median step and CPU time after
    ``warmup``, its throughput, final loss and the load average around it."""
    timed = timed_steps(launch.ranks, warmup)
    logged = [s["loss"] for s in launch.ranks[0]["steps"] if not math.isnan(s["loss"])]  # NaN: a step that did not log
    if not logged:
        raise RuntimeError("no step logged a loss: lower logging_steps below the number of steps")
    step_time = median_of(timed, "wall_s")
    return {"step_time_s": step_time, "cpu_time_s": median_of(timed, "cpu_s"),
            "samples_per_s": samples_per_step / step_time, "final_loss": logged[-1],
            "loadavg_before": launch.loadavg_before, "loadavg_after": launch.loadavg_after}


def load_spread(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The 1-minute load average before and after every run."""
    return spread([r["loadavg_before"][0] for r in runs] + [r["loadavg_after"][0] for r in runs])
