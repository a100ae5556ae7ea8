"""``hftk bench scaling``: throughput at 1..N processes, scaling efficiency, time to a target loss.

Weak scaling: every rank keeps the same micro-batch, so N processes see N times the samples per
step; efficiency(N) = throughput(N) / (N * throughput(1)). Each process count is launched
``repeats`` times, the counts interleaved (1 2 ... N, then N ... 1) so that load drifting on a
shared machine hits all of them alike; each launch is timed as the median of ``steps`` optimizer
steps after ``warmup``. Time to the target loss counts every step from the first, warm-up included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hftk.bench.charts import errorbar, figure, finish, fmt_spread, save
from hftk.bench.launch import BENCH_TRAIN_ARGS, DEFAULT_MODEL, max_processes, run_workers, threads_per_rank
from hftk.bench.stats import load_spread, spread, timed_run
from hftk.core.errors import HftkError

OPTION_HELP = {
    "nprocs": "comma-separated process counts (default 1, 2, 4, ... up to one per GPU, or per core on CPU)",
    "strategy": "parallelism to scale (hftk train --strategy)",
    "micro_batch": "sequences per rank per step (weak scaling: fixed per rank)",
    "warmup": "untimed steps at the start of each launch (>= 3 keeps the profiled step 3 out of the timing)",
    "steps": "timed steps per launch (their median is the launch's step time)",
    "repeats": "launches per process count",
    "target_loss": "training loss whose first crossing sets the time to target",
}


def default_nprocs() -> list[int]:
    """1, 2, 4, ... up to the machine's processes (and that count itself)."""
    top = max_processes()
    return sorted({2**i for i in range(top.bit_length())} | {top})


def check_options(nprocs: list[int] | None = None, strategy: str = "ddp", repeats: int = 3, steps: int = 20,
                  **_: Any) -> None:
    """Bad input fails before any launch."""
    from hftk.config import strategy_table

    strategy_table.get(strategy)
    if nprocs and min(nprocs) < 1:
        raise HftkError("bench.nprocs", "process counts must be at least 1.", "use e.g. 1,2.")
    if nprocs and torch.cuda.is_available() and max(nprocs) > max_processes():
        raise HftkError("bench.nprocs", f"{max(nprocs)} processes but {max_processes()} GPUs.",
                        f"use counts up to {max_processes()}.")
    if repeats < 1 or steps < 1:
        raise HftkError("bench.repeats", "repeats and steps must be at least 1.", "use e.g. 3 repeats of 20 steps.")


def time_to_target(ranks: list[dict[str, Any]], target: float) -> dict[str, float | None]:
    """Seconds and steps from the start until the logged loss first reaches ``target`` (None: never)."""
    elapsed = 0.0
    for i, step in enumerate(ranks[0]["steps"]):
        elapsed += max(r["steps"][i]["wall_s"] for r in ranks)
        if step["loss"] <= target:
            return {"time_to_target_s": elapsed, "steps_to_target": i + 1}
    return {"time_to_target_s": None, "steps_to_target": None}


def run_scaling_bench(out_dir: Path, nprocs: list[int] | None = None, strategy: str = "ddp",
                      model: str = DEFAULT_MODEL, block_size: int = 128, micro_batch: int = 8,
                      learning_rate: float = 1e-3, warmup: int = 3, steps: int = 20, repeats: int = 3,
                      target_loss: float = 6.0, train_args: list[str] | None = None,
                      timeout: float = 600) -> dict[str, Any]:
    """Launch the Trainer at each process count ``repeats`` times; return the measured figures."""
    check_options(nprocs, strategy, repeats, steps)
    out_dir = Path(out_dir)
    nprocs = sorted(nprocs or default_nprocs())
    threads = threads_per_rank(max(nprocs))
    argv = [*BENCH_TRAIN_ARGS, "--model_name_or_path", model, "--block_size", str(block_size),
            "--per_device_train_batch_size", str(micro_batch), "--learning_rate", str(learning_rate),
            "--strategy", strategy, "--max_steps", str(warmup + steps), *(train_args or [])]
    runs = []
    for rep in range(repeats):
        for n in (nprocs if rep % 2 == 0 else nprocs[::-1]):
            work = out_dir / f"n{n}-r{rep}"
            launch = run_workers(n, {"mode": "trainer", "argv": [*argv, "--output_dir", str(work / "run")]},
                                 work, timeout, threads)
            run = {"nproc": n, "repeat": rep, **timed_run(launch, warmup, n * micro_batch)}
            runs.append({**run, "tokens_per_s": n * micro_batch * block_size / run["step_time_s"],
                         **time_to_target(launch.ranks, target_loss), "launch_wall_s": launch.wall_s})
    result: dict[str, Any] = {
        "strategy": strategy, "model": model, "block_size": block_size, "micro_batch_per_rank": micro_batch,
        "warmup_steps": warmup, "timed_steps": steps, "repeats": repeats, "threads_per_rank": threads,
        "target_loss": target_loss, "runs": runs, "by_nproc": summarize_runs(runs, nprocs),
        "loadavg_1min": load_spread(runs),
    }
    return finish(result, table, chart, out_dir / "scaling.png")


def summarize_runs(runs: list[dict[str, Any]], nprocs: list[int]) -> dict[str, dict[str, Any]]:
    """Per process count: spreads over repeats; efficiency pairs each repeat with the same repeat's base."""
    base_n = nprocs[0]
    base = {r["repeat"]: r["samples_per_s"] for r in runs if r["nproc"] == base_n}
    base_cpu = {r["repeat"]: r["cpu_time_s"] for r in runs if r["nproc"] == base_n}
    out: dict[str, dict[str, Any]] = {}
    for n in nprocs:
        mine = [r for r in runs if r["nproc"] == n]
        reached = [r["time_to_target_s"] for r in mine if r["time_to_target_s"] is not None]
        out[str(n)] = {
            **{k: spread([r[k] for r in mine]) for k in ("samples_per_s", "tokens_per_s", "step_time_s", "cpu_time_s")},
            "efficiency": spread([r["samples_per_s"] / (n / base_n * base[r["repeat"]]) for r in mine]),
            # each rank's work for the same micro-batch, alone vs among n: steady even on a busy machine,
            # but blind to time spent waiting (exposed communication, stragglers)
            "cpu_efficiency": spread([base_cpu[r["repeat"]] / r["cpu_time_s"] for r in mine]),
            "time_to_target_s": spread(reached) if reached else None,
            "target_reached": f"{len(reached)}/{len(mine)}",
        }
    return out


def table(result: dict[str, Any]) -> dict[str, Any]:
    rows = [[n, fmt_spread(s["samples_per_s"]), fmt_spread(s["step_time_s"], 3), fmt_spread(s["cpu_time_s"], 3),
             fmt_spread(s["efficiency"], 2), fmt_spread(s["cpu_efficiency"], 2), fmt_spread(s["time_to_target_s"]),
             s["target_reached"]] for n, s in result["by_nproc"].items()]
    return {"title": f"Scaling ({result['strategy']}, {result['micro_batch_per_rank']} x {result['block_size']} tokens "
                     f"per rank, median [min-max] of {result['repeats']} launches x {result['timed_steps']} steps)",
            "columns": ["processes", "samples/s", "step time s", "CPU s/step/rank", "efficiency", "CPU-time efficiency",
                        f"time to loss {result['target_loss']} s", "reached"],
            "rows": rows}


def chart(result: dict[str, Any], path: Path) -> str:
    ns = [int(n) for n in result["by_nproc"]]
    stats = list(result["by_nproc"].values())
    fig, (thr, eff) = figure(2, f"{result['strategy']} scaling, {result['model']}")
    errorbar(thr, ns, [s["samples_per_s"] for s in stats], "measured")
    base = stats[0]["samples_per_s"]["median"] / ns[0]
    thr.plot(ns, [base * n for n in ns], "--", color="gray", label="linear")
    thr.set(xlabel="processes", ylabel="samples / s", xticks=ns)
    thr.legend(fontsize=8)
    errorbar(eff, ns, [s["efficiency"] for s in stats], "wall-clock")
    errorbar(eff, ns, [s["cpu_efficiency"] for s in stats], "CPU time")
    eff.axhline(1.0, ls="--", color="gray")
    eff.set(xlabel="processes", ylabel="scaling efficiency", xticks=ns, ylim=(0, 1.3))
    eff.legend(fontsize=8)
    return save(fig, path)
