"""``hftk bench batch``: the largest micro-batch that fits a memory budget, per strategy, and the
micro-batch x gradient-accumulation pair that reaches a target global batch fastest.

One launch per strategy runs every trial in one process group (hftk's engine, a fresh Trainer
per trial): micro-batches 1, 2, 4, ... until the peak memory per rank (max over ranks: device
memory on GPU, resident set on CPU with glibc told to return freed memory) passes the budget or
the device runs out of memory; then each pair (b, global_batch / (b * ranks)) with b no larger
than the largest fitting micro-batch, timed over a few steps. A rank that runs out of memory ends
its launch (its peers' collectives could never pair up again); a new launch goes on with the
trials left.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from hftk.bench.charts import figure, finish, save
from hftk.bench.launch import BENCH_TRAIN_ARGS, DEFAULT_MODEL, max_processes, run_workers, threads_per_rank
from hftk.bench.stats import median_of, timed_steps
from hftk.core.errors import HftkError

GB = 2**30
# On CPU there is no device limit to find: a budget this small makes the search end within the
# bench's time on the built-in model. Pass --budget_gb for your real limit.
CPU_DEFAULT_BUDGET_GB = 1.0

OPTION_HELP = {
    "strategies": "comma-separated strategies to search (hftk train --strategy values)",
    "nproc": "processes (default: one per GPU, or per core on CPU)",
    "budget_gb": f"peak memory allowed per rank (default: the device's; {CPU_DEFAULT_BUDGET_GB} GB on CPU)",
    "max_micro_batch": "largest micro-batch the search tries",
    "global_batch": "sequences per optimizer step that every accumulation pair reaches",
    "warmup": "untimed steps per trial",
    "steps": "timed steps per trial",
    "timeout": "seconds before the launch is killed",
}


def check_options(strategies: list[str] | None = None, nproc: int | None = None, global_batch: int = 32,
                  max_micro_batch: int = 64, **_: Any) -> None:
    """Bad input fails before any launch."""
    from hftk.config import strategy_table as known

    for name in strategies or ["ddp"]:
        known.get(name)
    nproc = nproc or max_processes()
    if global_batch % nproc:
        raise HftkError("bench.global_batch", f"{global_batch} is not divisible by {nproc} processes.",
                        f"use a multiple of {nproc}.")
    if max_micro_batch < 1:
        raise HftkError("bench.max_micro_batch", "must be at least 1.", "use e.g. 64.")


def plan_trials(nproc: int, global_batch: int, max_micro_batch: int, work: Path) -> list[dict[str, Any]]:
    """Search trials (powers of two up to ``max_micro_batch``) then the accumulation pairs."""
    per_rank = global_batch // nproc
    search = _powers_of_two(max_micro_batch)
    pairs = [b for b in _powers_of_two(per_rank) if per_rank % b == 0 and b < per_rank]
    trials = [{"kind": "search", "micro_batch": b, "accumulation": 1} for b in search]
    if per_rank not in search:
        trials.append({"kind": "pair", "micro_batch": per_rank, "accumulation": 1})
    trials += [{"kind": "pair", "micro_batch": b, "accumulation": per_rank // b} for b in sorted(pairs, reverse=True)]
    return [{**trial, "output_dir": str(work / f"trial{i}")} for i, trial in enumerate(trials)]


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length())]  # 1, 2, 4, ... up to limit


def run_batch_bench(out_dir: Path, strategies: list[str] | None = None, nproc: int | None = None,
                    model: str = DEFAULT_MODEL, block_size: int = 128, budget_gb: float | None = None,
                    max_micro_batch: int = 64, global_batch: int = 32, learning_rate: float = 1e-3, warmup: int = 1,
                    steps: int = 2, train_args: list[str] | None = None, timeout: float = 900) -> dict[str, Any]:
    """Per strategy: memory search and accumulation pairs; returns the measured figures."""
    out_dir = Path(out_dir)
    strategies = strategies or ["ddp"]
    nproc = nproc or max_processes()
    if not budget_gb:  # the device's memory on GPU
        cuda = torch.cuda.is_available()
        budget_gb = torch.cuda.get_device_properties(0).total_memory / GB if cuda else CPU_DEFAULT_BUDGET_GB
    threads = threads_per_rank(nproc)
    argv = [*BENCH_TRAIN_ARGS, "--model_name_or_path", model, "--block_size", str(block_size),
            "--learning_rate", str(learning_rate), "--max_steps", str(warmup + steps), *(train_args or [])]
    check_options(strategies, nproc, global_batch, max_micro_batch)
    per_strategy = {}
    for strategy in strategies:
        work = out_dir / strategy
        spec = {"mode": "batch", "argv": [*argv, "--strategy", strategy], "budget_bytes": budget_gb * GB}
        ranks, loadavg = run_trials(nproc, spec, plan_trials(nproc, global_batch, max_micro_batch, work), work,
                                    timeout, threads)
        per_strategy[strategy] = {**analyse(ranks, nproc, block_size, warmup, global_batch), **loadavg}
    result: dict[str, Any] = {"model": model, "nproc": nproc, "block_size": block_size, "budget_gb": budget_gb,
                              "global_batch": global_batch, "max_micro_batch_tried": max_micro_batch,
                              "timed_steps": steps, "threads_per_rank": threads, "strategies": per_strategy}
    return finish(result, table, chart, out_dir / "batch.png")


def run_trials(nproc: int, spec: dict[str, Any], trials: list[dict[str, Any]], work: Path, timeout: float,
               threads: int) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    """Every rank's trial records, over as many launches as out-of-memory trials end; and the load
    average before the first launch and after the last."""
    records: list[list[dict[str, Any]]] = [[] for _ in range(nproc)]
    largest_fit, pending, before = 0, trials, list(os.getloadavg())
    for attempt in range(len(trials)):
        launch_dir = work if attempt == 0 else work / f"after_oom{attempt}"
        progress = launch_dir / "progress"
        try:
            launch = run_workers(nproc, {**spec, "trials": pending, "largest_fit": largest_fit,
                                         "progress": str(progress)}, launch_dir, timeout, threads)
        except RuntimeError:
            done = [json.loads(p.read_text())["trials"] if p.is_file() else []
                    for p in (progress / f"rank{r}.json" for r in range(nproc))]
            oom = next((t for rank in done for t in rank if t["oom"]), None)
            if oom is None:
                raise
            finished = set.intersection(*({t["output_dir"] for t in rank if not t["oom"]} for rank in done))
            for rank, mine in zip(records, done):
                rank += [t for t in mine if t["output_dir"] in finished] + [oom]
            largest_fit = max([t["micro_batch"] for t in records[0] if t["kind"] == "search" and t["fits"]], default=0)
            rest = pending[[t["output_dir"] for t in pending].index(oom["output_dir"]) + 1:]
            pending = [t for t in rest if t["kind"] == "pair"] if oom["kind"] == "search" else rest
            print(f"hftk bench batch: micro-batch {oom['micro_batch']} x {oom['accumulation']} ran out of device "
                  f"memory; {len(pending)} trial(s) left", flush=True)
            if pending:
                continue
        else:
            for rank, launched in zip(records, launch.ranks):
                rank += launched["trials"]
        break
    return [{"trials": rank} for rank in records], {"loadavg_before": before, "loadavg_after": list(os.getloadavg())}


def analyse(ranks: list[dict[str, Any]], nproc: int, block_size: int, warmup: int, global_batch: int) -> dict[str, Any]:
    """Largest fitting micro-batch and the fastest pair, from every rank's trial records."""
    trials = []
    for i, trial in enumerate(ranks[0]["trials"]):
        record = {k: trial[k] for k in ("kind", "micro_batch", "accumulation", "peak_mem_bytes", "oom", "fits")}
        peak = record.pop("peak_mem_bytes")
        record["peak_mem_gb"] = None if peak is None else peak / GB  # None: out of memory, nothing measured
        if not trial["oom"]:
            step_time = median_of(timed_steps([r["trials"][i] for r in ranks], warmup), "wall_s")
            record["samples_per_s"] = trial["micro_batch"] * trial["accumulation"] * nproc / step_time
            record["tokens_per_s"] = record["samples_per_s"] * block_size
        trials.append(record)
    fitting = [t for t in trials if t["kind"] == "search" and t["fits"]]
    if not fitting:
        raise RuntimeError("not even micro-batch 1 fits the memory budget: raise --budget_gb")
    pairs = [t for t in trials if t["fits"] and t["micro_batch"] * t["accumulation"] * nproc == global_batch]
    best = max(pairs, key=lambda t: t["samples_per_s"])
    return {"trials": trials, "largest_micro_batch": max(t["micro_batch"] for t in fitting),
            "peak_mem_gb_at_largest": max(fitting, key=lambda t: t["micro_batch"])["peak_mem_gb"],
            "best_pair": {k: best[k] for k in ("micro_batch", "accumulation", "samples_per_s")},
            "budget_hit": any(t["kind"] == "search" and not t["fits"] for t in trials)}


def table(result: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for name, s in result["strategies"].items():
        best = s["best_pair"]
        largest = f"{s['largest_micro_batch']}" + ("" if s["budget_hit"] else f" (all tried up to {result['max_micro_batch_tried']} fit)")
        rows.append([name, largest, f"{s['peak_mem_gb_at_largest']:.2f}",
                     f"{best['micro_batch']} x {best['accumulation']}", f"{best['samples_per_s']:.1f}"])
    return {"title": f"Batch size ({result['nproc']} processes, budget {result['budget_gb']:.2f} GB per rank, "
                     f"global batch {result['global_batch']})",
            "columns": ["strategy", "largest micro-batch", "its peak GB/rank", "best micro-batch x accumulation",
                        "samples/s"], "rows": rows}


def chart(result: dict[str, Any], path: Path) -> str:
    fig, (mem, thr) = figure(2, f"micro-batch vs memory and accumulation pairs ({result['model']})")
    for name, s in result["strategies"].items():
        search = [t for t in s["trials"] if t["kind"] == "search" and t["peak_mem_gb"] is not None]
        mem.plot([t["micro_batch"] for t in search], [t["peak_mem_gb"] for t in search], marker="o", label=name)
        pairs = sorted((t for t in s["trials"] if "samples_per_s" in t and
                        t["micro_batch"] * t["accumulation"] * result["nproc"] == result["global_batch"]),
                       key=lambda t: t["micro_batch"])
        thr.plot([t["micro_batch"] for t in pairs], [t["samples_per_s"] for t in pairs], marker="o", label=name)
    mem.axhline(result["budget_gb"], ls="--", color="red", label="budget")
    mem.set(xscale="log", xlabel="micro-batch per rank", ylabel="peak GB per rank")
    thr.set(xscale="log", xlabel=f"micro-batch (accumulation fills global batch {result['global_batch']})",
            ylabel="samples / s")
    mem.legend(fontsize=8)
    thr.legend(fontsize=8)
    return save(fig, path)
