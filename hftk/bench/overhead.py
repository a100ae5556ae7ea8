"""``hftk bench overhead``: hftk's DDP Trainer path against a hand-written Accelerate loop.

Same model, data, micro-batch, processes, optimizer (fused AdamW, the Trainer's default), LR
schedule and clipping (see :func:`hftk.bench.worker.run_hand_loop`). hftk runs with its
monitoring callbacks on, as a user gets it. The two are launched alternately (hftk, hand, hftk,
hand, ...) and compared pairwise, so load drifting on a shared machine hits both alike.

Two measures: wall-clock throughput (what users feel; +-10-20 % noise on a shared CPU) and
process CPU time per step (each rank's own work, far steadier: the low-noise overhead measure).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hftk.bench.charts import figure, finish, fmt_spread, save, whiskers
from hftk.bench.launch import BENCH_TRAIN_ARGS, DEFAULT_MODEL, run_workers, threads_per_rank
from hftk.bench.stats import load_spread, spread, timed_run

VARIANTS = ("hftk", "hand")
MODES = {"hftk": "trainer", "hand": "hand"}

OPTION_HELP = {
    "nproc": "DDP processes of both variants",
    "warmup": "untimed steps at the start of each launch",
    "steps": "timed steps per launch",
    "repeats": "interleaved (hftk, hand) launch pairs",
    "logging_steps": "both variants reduce and log the loss every this many steps",
}


def run_overhead_bench(out_dir: Path, nproc: int = 2, model: str = DEFAULT_MODEL, block_size: int = 128,
                       micro_batch: int = 8, learning_rate: float = 1e-3, warmup: int = 3, steps: int = 20,
                       repeats: int = 3, logging_steps: int = 5, train_args: list[str] | None = None,
                       timeout: float = 600) -> dict[str, Any]:
    """``repeats`` interleaved pairs of launches; ratios > 1 mean hftk is faster than the hand loop.
    Both log (reduce the loss across ranks) every ``logging_steps`` steps: hftk's default of 5."""
    out_dir = Path(out_dir)
    threads = threads_per_rank(nproc)
    argv = [*BENCH_TRAIN_ARGS, "--model_name_or_path", model, "--block_size", str(block_size),
            "--per_device_train_batch_size", str(micro_batch), "--learning_rate", str(learning_rate),
            "--strategy", "ddp", "--max_steps", str(warmup + steps), "--logging_steps", str(logging_steps),
            *(train_args or [])]
    runs = []
    for rep in range(repeats):
        for variant in VARIANTS:
            work = out_dir / f"{variant}-r{rep}"
            launch = run_workers(nproc, {"mode": MODES[variant], "argv": [*argv, "--output_dir", str(work / "run")]},
                                 work, timeout, threads)
            runs.append({"variant": variant, "repeat": rep, **timed_run(launch, warmup, nproc * micro_batch)})
    pick = {(r["variant"], r["repeat"]): r for r in runs}
    result: dict[str, Any] = {
        "nproc": nproc, "model": model, "block_size": block_size, "micro_batch_per_rank": micro_batch,
        "warmup_steps": warmup, "timed_steps": steps, "repeats": repeats, "threads_per_rank": threads, "runs": runs,
        "by_variant": {v: {key: spread([r[key] for r in runs if r["variant"] == v])
                           for key in ("samples_per_s", "step_time_s", "cpu_time_s")} for v in VARIANTS},
        # hftk throughput / hand-loop throughput, per interleaved pair
        "throughput_ratio": spread([pick["hand", i]["step_time_s"] / pick["hftk", i]["step_time_s"]
                                    for i in range(repeats)]),
        # hand-loop CPU time / hftk CPU time per step, per pair (1.0: no overhead)
        "cpu_ratio": spread([pick["hand", i]["cpu_time_s"] / pick["hftk", i]["cpu_time_s"] for i in range(repeats)]),
        "loadavg_1min": load_spread(runs),
    }
    return finish(result, table, chart, out_dir / "overhead.png")


def table(result: dict[str, Any]) -> dict[str, Any]:
    rows = [[v, fmt_spread(s["samples_per_s"]), fmt_spread(s["step_time_s"], 3), fmt_spread(s["cpu_time_s"], 3)]
            for v, s in result["by_variant"].items()]
    rows.append(["hftk / hand", fmt_spread(result["throughput_ratio"], 3), "", fmt_spread(result["cpu_ratio"], 3)])
    return {"title": f"Overhead: hftk Trainer path vs hand-written Accelerate loop (DDP, {result['nproc']} processes, "
                     f"{result['repeats']} interleaved pairs x {result['timed_steps']} steps; ratios > 1 favour hftk)",
            "columns": ["variant", "samples/s", "step time s", "CPU s/step/rank"], "rows": rows}


def chart(result: dict[str, Any], path: Path) -> str:
    fig, (wall, cpu) = figure(2, f"hftk vs hand-written Accelerate loop ({result['nproc']} processes)")
    for ax, key, label in ((wall, "step_time_s", "wall s / step"), (cpu, "cpu_time_s", "CPU s / step / rank")):
        med, err = whiskers([result["by_variant"][v][key] for v in VARIANTS])
        ax.bar(VARIANTS, med, yerr=err, capsize=6, color=["tab:blue", "tab:gray"])
        ax.set(ylabel=label)
    return save(fig, path)
