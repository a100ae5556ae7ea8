"""``hftk bench moe``: a mixture of experts under ddp, fsdp and ep side by side, in one run on the same model and
data, and ep under each experts implementation.

Every row trains the same model for a few steps through hftk's own engine (:mod:`hftk.bench.memory_worker`: every
rank's training-phase peak and counted model state) at ``nproc`` ranks: ``ddp``, ``fsdp`` and ``ep`` (ep groups of
all ranks) with the experts implementation hftk picks on this device, then ``ep <implementation>`` for every other
one asked (transformers' eager loop over the experts hit, ``batched_mm``, ``grouped_mm`` where the device runs it).
Per row: tokens/s (the whole world's, from the median step time after the first step), the worst rank's peak and
model state beside the plan's peak for it (:mod:`hftk.plan.estimate`), and under ep the bytes each rank's
all-to-alls send per step (hftk's comm accounting, :mod:`hftk.comm.accounting`: ``ep_all_to_all_bytes_per_step``
in the run's metrics). Ratios are to ddp's row of the same run. With ``repeats`` above 1 the rows are launched
again in reverse order (load drifting on a shared machine hits all alike) and each figure is the median.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

from hftk.bench.charts import figure, finish, save
from hftk.bench.launch import BENCH_TRAIN_ARGS, threads_per_rank, torchrun_module
from hftk.bench.report import markdown_table
from hftk.core.errors import HftkError
from hftk.models.moe import EXPERTS_IMPLEMENTATIONS
from hftk.plan.estimate import MIB

DEFAULT_MODEL = "builtin:qwen3-moe-small"
STRATEGIES = ("ddp", "fsdp", "ep")
OPTION_HELP = {
    "nproc": "processes (ranks) of every run",
    "strategies": "comma-separated strategies, each at the device's experts implementation",
    "implementations": "comma-separated experts implementations to run ep with as well (default: every one this "
                       "device runs)",
    "steps": "optimizer steps per run (the median of those after the first is timed)",
    "repeats": "launches per row (interleaved; medians)",
}


def device_implementations() -> tuple[str, ...]:
    """The experts implementations this device runs: grouped_mm needs the CPU (torch >= 2.9) or CUDA 8.0+."""
    import torch

    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0):
        return tuple(i for i in EXPERTS_IMPLEMENTATIONS if i != "grouped_mm")
    return EXPERTS_IMPLEMENTATIONS


def rows(strategies: tuple[str, ...], implementations: tuple[str, ...]) -> dict[str, list[str]]:
    """Row name -> its hftk train options: each strategy at the device's own choice, then ep at the others."""
    import torch

    from hftk.models.moe import choose_experts_implementation

    default = choose_experts_implementation(None, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    table = {s: ["--strategy", s, "--experts_implementation", default] for s in strategies}
    table |= {f"ep {i}": ["--strategy", "ep", "--experts_implementation", i] for i in implementations if i != default}
    return table


def check_options(strategies: tuple[str, ...] = STRATEGIES, implementations: tuple[str, ...] | None = None,
                  nproc: int = 2, steps: int = 6, repeats: int = 1, **_: Any) -> None:
    """Bad input fails before any launch."""
    from hftk.config import strategy_table

    for name in strategies:
        strategy_table.get(name)
    unknown = [i for i in implementations or () if i not in device_implementations()]
    if unknown:
        raise HftkError("--implementations", f"'{unknown[0]}' is not an experts implementation this device runs.",
                        f"use some of: {', '.join(device_implementations())}.")
    if nproc < 2:
        raise HftkError("--nproc", f"fsdp and ep need 2 ranks or more (got {nproc}).", "pass --nproc 2.")
    if steps < 2 or repeats < 1:
        raise HftkError("--steps", "the first step is not timed: run 2 or more, at least once.", "pass --steps 6.")


def run_moe_bench(out_dir: Path, nproc: int = 2, model: str = DEFAULT_MODEL, block_size: int = 64,
                  micro_batch: int = 4, steps: int = 6, repeats: int = 1,
                  strategies: tuple[str, ...] = STRATEGIES, implementations: tuple[str, ...] | None = None,
                  train_args: list[str] | None = None, timeout: float = 900) -> dict[str, Any]:
    """Every row at ``nproc`` ranks, ``repeats`` times; write ``moe.md``, ``moe.png`` and ``moe.json``."""
    from hftk.bench.memory import predict

    implementations = tuple(implementations or device_implementations())
    check_options(tuple(strategies), implementations, nproc, steps, repeats)
    out_dir = Path(out_dir)
    argv = [*BENCH_TRAIN_ARGS, "--model_name_or_path", model, "--block_size", str(block_size),
            "--per_device_train_batch_size", str(micro_batch), "--max_steps", str(steps),
            "--comm_profile_steps", "0", *(train_args or [])]
    plan = predict(argv, nproc, tuple(strategies))
    table_rows = rows(tuple(strategies), implementations)
    launches: dict[str, list[dict[str, Any]]] = {name: [] for name in table_rows}
    load_before = list(os.getloadavg())
    for repeat in range(repeats):
        for name in (list(table_rows) if repeat % 2 == 0 else list(table_rows)[::-1]):
            work = out_dir / f"{name.replace(' ', '_')}-r{repeat}"
            torchrun_module(nproc, "hftk.bench.memory_worker",
                            [*argv, *table_rows[name], "--output_dir", str(work / "run"), "--memory_out",
                             str(work / "memory.json")], work, timeout, threads_per_rank(nproc))
            launches[name].append(measured(work, nproc * micro_batch * block_size))
    runs = {name: summarise(found, plan.get(table_rows[name][1])) for name, found in launches.items()}
    if "ddp" in runs:
        for run in runs.values():
            run["tokens_per_s_vs_ddp"] = run["tokens_per_s"] / runs["ddp"]["tokens_per_s"]
            run["peak_vs_ddp"] = run["peak_mib"] / runs["ddp"]["peak_mib"]
    result: dict[str, Any] = {
        "model": model, "nproc": nproc, "block_size": block_size, "micro_batch": micro_batch, "steps": steps,
        "repeats": repeats, "loadavg_before": load_before, "loadavg_after": list(os.getloadavg()), "rows": runs,
    }
    finish(result, table, chart, out_dir / "moe.png")
    (out_dir / "moe.json").write_text(json.dumps(result, indent=1))
    (out_dir / "moe.md").write_text("\n".join([*markdown_table(result["table"]), "", "![moe](moe.png)", ""]))
    return result


def measured(work: Path, tokens_per_step: int) -> dict[str, Any]:
    """One launch: its median step after the first, the world's tokens/s, every rank's peak and model state, and the
    all-to-all bytes rank 0 sent per step (ep rows)."""
    from hftk.telemetry.metrics import read_jsonl

    logged = [r for r in read_jsonl(work / "run" / "metrics.jsonl") if "loss" in r and r.get("step", 0) >= 2]
    if not logged:
        raise HftkError("moe.steps", f"{work} logged no step after the first.", "run 2 steps or more.")
    step_time = statistics.median(r["step_time_s"] for r in logged)
    ranks = json.loads((work / "memory.json").read_text())["ranks"]
    sent = [r["ep_all_to_all_bytes_per_step"] for r in logged if "ep_all_to_all_bytes_per_step" in r]
    return {"step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time,
            "peak_mib": max(r["peak"] for r in ranks) / MIB, "model_state_mib": max(r["total"] for r in ranks) / MIB,
            **({"all_to_all_bytes_per_step": statistics.median(sent)} if sent else {})}


def summarise(launches: list[dict[str, Any]], plan: Any) -> dict[str, Any]:
    """A row: the median over its launches (the all-to-all bytes where it has some: ep), and the plan's peak for its
    strategy."""
    keys = ("step_time_s", "tokens_per_s", "peak_mib", "model_state_mib", "all_to_all_bytes_per_step")
    out = {key: statistics.median(run[key] for run in launches) for key in keys if key in launches[0]}
    return {**out, "plan_peak_mib": plan.device_total / MIB}


def table(result: dict[str, Any]) -> dict[str, Any]:
    def ratio(run: dict[str, Any], key: str) -> str:
        return f"{run[key]:.2f}" if key in run else "-"

    rows = [[name, f"{r['tokens_per_s']:.0f}", ratio(r, "tokens_per_s_vs_ddp"), f"{r['peak_mib']:.0f}",
             ratio(r, "peak_vs_ddp"), f"{r['model_state_mib']:.1f}",
             f"{r['plan_peak_mib']:.0f}",
             f"{r['all_to_all_bytes_per_step'] / MIB:.2f}" if "all_to_all_bytes_per_step" in r else "-"]
            for name, r in result["rows"].items()]
    return {"title": f"mixture of experts, {result['model']}, {result['nproc']} ranks, micro-batch "
                     f"{result['micro_batch']} x {result['block_size']} tokens per rank, median of "
                     f"{result['repeats']} launch(es) x {result['steps'] - 1} steps",
            "columns": ["row", "tokens/s", "x ddp", "peak MiB (max rank)", "x ddp", "model state MiB",
                        "plan peak MiB", "all-to-all MiB/step/rank"],
            "rows": rows}


def chart(result: dict[str, Any], path: Path) -> str:
    runs = result["rows"]
    names = list(runs)
    fig, (speed, memory) = figure(2, f"mixture of experts at {result['nproc']} ranks ({result['model']})")
    xs = range(len(names))
    speed.bar(xs, [runs[n]["tokens_per_s"] for n in names])
    speed.set(xticks=list(xs), ylabel="tokens / s (all ranks)")
    speed.set_xticklabels(names, rotation=30, fontsize=7)
    memory.bar(xs, [runs[n]["peak_mib"] for n in names], label="measured peak")
    memory.set(xticks=list(xs), ylabel="MiB per rank (max)")
    memory.set_xticklabels(names, rotation=30, fontsize=7)
    return save(fig, path)
