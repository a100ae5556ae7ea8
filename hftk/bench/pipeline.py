"""``hftk bench pipeline``: the measured pipeline bubble against theory, every schedule side by side.

Theory (equal stages, free communication), P ranks, M micro-batches, V stages per rank:

- GPipe and 1F1B: each rank idles (P-1)/(M+P-1) of the step;
- interleaved 1F1B: (P-1)/(V*M+P-1) for M >= P (Narayanan et al., 2021); with M < P the
  chunks of one micro-batch cannot overlap and the same counting gives (V(P-M)+M-1)/(VP+M-1).

How the bubble is measured. Each rank times every forward, loss and backward it runs (wall
interval and the CPU time of its own thread) inside steps that start together after a barrier
(:mod:`hftk.bench.pipeline_worker`); all configurations take turns step by step.

- *wall clock*: bubble = 1 - sum over ranks of compute time / (P x step span). Direct, but on a
  machine shared with other jobs a rank that is descheduled in the middle of a forward makes
  its neighbour wait, and that wait counts as bubble although the schedule caused none.
- *replay* (the figure the target is checked on): the same steps rebuilt from what each rank
  measured: its actions in the order it really ran them, each lasting the CPU time its thread
  spent on it, each forward waiting for the previous stage's forward of that micro-batch and
  each backward for the next stage's backward. Idle time then comes only from the schedule and
  the measured stage costs (including any imbalance between stages), not from other processes
  taking the cores; communication time is left out (it is what the wall-clock column adds).
  The column "CPU / wall in compute" says how much of the compute intervals the ranks really
  ran: near 100 % the wall-clock figure is trustworthy too; far below, other load distorts it.

The model is GPT-2-shaped with a small vocabulary so that the stages (balanced by parameter
count, as in training) also cost about the same to compute.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hftk.bench.charts import errorbar, figure, finish, fmt_spread, save
from hftk.bench.launch import Machine, run_workers, threads_per_rank
from hftk.bench.stats import percent, spread
from hftk.core.errors import HftkError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
MICROBATCHES = (1, 2, 4, 8)
TARGET_PP = 5.0
OPTION_HELP = {
    "nproc": "pipeline ranks P (one stage each; V each for interleaved)",
    "microbatches": "comma-separated micro-batch counts M",
    "schedules": "comma-separated schedules",
    "virtual_stages": "stages per rank V for interleaved_1f1b",
    "steps": "timed steps per configuration",
    "warmup": "untimed steps per configuration first (shape inference, allocator warm-up)",
    "rows_per_microbatch": "sequences per micro-batch (fixed, so per-action cost does not depend on M)",
    "n_layer": "decoder blocks of the benchmark model",
    "n_embd": "hidden size of the benchmark model",
    "timeout": "seconds before the launch is killed",
}


def theory(schedule: str, m: int, p: int, v: int) -> float:
    """Idle fraction of each rank's step for equal stages and free communication."""
    if schedule != "interleaved_1f1b":
        return (p - 1) / (m + p - 1)
    if m >= p:
        return (p - 1) / (v * m + p - 1)
    return (v * (p - m) + m - 1) / (v * p + m - 1)


def replay(ranks_events: list[list[list[Any]]], num_stages: int) -> float:
    """Bubble of one step rebuilt from per-rank action order and per-action CPU time (see module doc)."""
    actions: list[list[tuple[str, int, int, float]]] = []
    for events in ranks_events:
        merged: list[tuple[str, int, int, float]] = []
        for kind, stage, mb, _, _, cpu in events:
            if kind == "L":  # the loss belongs to the last stage's forward of that micro-batch
                i = max(i for i, a in enumerate(merged) if a[:3] == ("F", stage, mb))
                merged[i] = (*merged[i][:3], merged[i][3] + cpu)
            else:
                merged.append((kind, stage, mb, cpu))
        actions.append(merged)
    done: dict[tuple[str, int, int], float] = {}
    free, pos = [0.0] * len(actions), [0] * len(actions)
    while any(pos[r] < len(actions[r]) for r in range(len(actions))):
        progressed = False
        for r, queue in enumerate(actions):
            while pos[r] < len(queue):
                kind, stage, mb, cost = queue[pos[r]]
                dep = ("F", stage - 1, mb) if kind == "F" and stage > 0 else (
                    ("B", stage + 1, mb) if kind == "B" and stage < num_stages - 1 else None)
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done[dep] if dep else 0.0)
                free[r] = done[(kind, stage, mb)] = start + cost
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the recorded actions wait on each other: the trace is inconsistent")
    busy = sum(a[3] for queue in actions for a in queue)
    return 1.0 - busy / (len(actions) * max(free))


def wall_bubble(steps: list[dict[str, Any]]) -> float:
    """Bubble of one step from wall clock: compute intervals against the common step span."""
    span = max(s["end"] for s in steps) - min(s["start"] for s in steps)
    busy = sum(e[4] - e[3] for s in steps for e in s["events"])
    return 1.0 - busy / (len(steps) * span)


def stage_costs(ranks: list[dict[str, Any]], index: int) -> dict[str, dict[str, float]]:
    """Median CPU milliseconds of one forward (+ loss) and one backward per stage."""
    per: dict[str, list[float]] = {}
    for rank in ranks:
        for step in rank["records"][index]["steps"]:
            action: dict[tuple[str, int, int], float] = {}
            for kind, stage, mb, _, _, cpu in step["events"]:
                key = ("B" if kind == "B" else "F", stage, mb)
                action[key] = action.get(key, 0.0) + cpu * 1e3
            for (kind, stage, _), ms in action.items():
                per.setdefault(f"stage{stage}_{kind}", []).append(ms)
    return {k: spread(v) for k, v in sorted(per.items())}


def summarise(ranks: list[dict[str, Any]], pp: int, virtual: int) -> list[dict[str, Any]]:
    rows = []
    for index, record in enumerate(ranks[0]["records"]):
        row = {"schedule": record["schedule"], "microbatches": record["microbatches"],
               "theory": theory(record["schedule"], record["microbatches"], pp, virtual),
               "theory_non_interleaved": theory("gpipe", record["microbatches"], pp, virtual)}
        if "skipped" in record:
            rows.append({**row, "skipped": record["skipped"]})
            continue
        steps = [[rank["records"][index]["steps"][i] for rank in ranks] for i in range(len(record["steps"]))]
        spans = [max(s["end"] for s in step) - min(s["start"] for s in step) for step in steps]
        on_cpu = [sum(e[5] for s in step for e in s["events"]) / sum(e[4] - e[3] for s in step for e in s["events"])
                  for step in steps]
        row.update(replay=spread([replay([s["events"] for s in step], record["stages"]) for step in steps]),
                   wall=spread([wall_bubble(step) for step in steps]), step_s=spread(spans),
                   compute_on_cpu=spread(on_cpu), stage_cpu_ms=stage_costs(ranks, index))
        row["replay_minus_theory_pp"] = 100 * (row["replay"]["median"] - row["theory"])
        row["wall_minus_theory_pp"] = 100 * (row["wall"]["median"] - row["theory"])
        rows.append(row)
    return rows


def table(result: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for r in result["rows"]:
        theory_cell = f"{100 * r['theory']:.1f}" + (
            f" ({100 * r['theory_non_interleaved']:.1f} w/o)" if r["schedule"] == "interleaved_1f1b" else "")
        measured = ["n/a", "n/a", "-", "-", r["skipped"]] if "skipped" in r else [
            fmt_spread(percent(r["replay"])), fmt_spread(percent(r["wall"])), f"{r['replay_minus_theory_pp']:+.1f}",
            f"{100 * r['compute_on_cpu']['median']:.0f}", f"{r['step_s']['median']:.2f}"]
        rows.append([r["schedule"], r["microbatches"], theory_cell, *measured])
    load = f"load {result['loadavg_before'][0]:.1f} -> {result['loadavg_after'][0]:.1f}"
    return {"title": f"Pipeline bubble, P={result['nproc']} ranks, V={result['virtual_stages']} for interleaved, "
                     f"{result['timed_steps']} timed steps each ({result['machine']['device']}, {load}); "
                     "% of each rank's step, median [min-max]",
            "columns": ["schedule", "M", "theory %", "measured: replay %", "measured: wall clock %",
                        "replay - theory (pp)", "CPU / wall in compute %", "step s (or why skipped)"],
            "rows": rows}


def chart(result: dict[str, Any], path: Path) -> str:
    schedules = list(dict.fromkeys(r["schedule"] for r in result["rows"]))
    fig, axes = figure(len(schedules), f"Pipeline bubble vs micro-batches, P={result['nproc']}")
    for ax, schedule in zip(axes, schedules):
        rows = [r for r in result["rows"] if r["schedule"] == schedule]
        ax.plot([r["microbatches"] for r in rows], [100 * r["theory"] for r in rows], "k--", label="theory")
        timed = [r for r in rows if "skipped" not in r]
        for key, marker, line, label in (("replay", "o", "-", "replay"), ("wall", "s", ":", "wall clock")):
            errorbar(ax, [r["microbatches"] for r in timed], [percent(r[key]) for r in timed], f"measured ({label})",
                     marker=marker, capsize=3, linestyle=line)
        ticks = sorted({r["microbatches"] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(m) for m in ticks])
        ax.set(xlabel="micro-batches M", ylabel="bubble, % of step", ylim=(0, 70))
        ax.set_title(schedule, fontsize=9)
        ax.legend(fontsize=7)
    return save(fig, path)


def check_options(nproc: int = 2, microbatches: list[int] = MICROBATCHES, schedules: list[str] = SCHEDULES,
                  virtual_stages: int = 2, n_layer: int = 8, **_: Any) -> None:
    """Before launching (``hftk bench`` calls it first): options the worker could only fail on."""
    if unknown := [s for s in schedules if s not in SCHEDULES]:
        raise HftkError("--schedules", f"unknown schedule '{unknown[0]}'.", f"use some of {', '.join(SCHEDULES)}.")
    if nproc < 2:
        raise HftkError("--nproc", f"a pipeline needs at least 2 ranks, got {nproc}.", "set --nproc 2 or more.")
    if not microbatches or min(microbatches) < 1:
        raise HftkError("--microbatches", "needs positive micro-batch counts.", "write e.g. --microbatches 1,2,4,8.")
    stages = nproc * (virtual_stages if "interleaved_1f1b" in schedules else 1)
    if n_layer < stages:
        raise HftkError("--n_layer", f"{stages} stages need at least {stages} decoder blocks, got {n_layer}.",
                        f"set --n_layer {stages} or more.")


def run_pipeline_bench(out_dir: Path, nproc: int = 2, microbatches: list[int] = MICROBATCHES,
                       schedules: list[str] = SCHEDULES, virtual_stages: int = 2, steps: int = 5, warmup: int = 2,
                       block_size: int = 128, rows_per_microbatch: int = 2, n_layer: int = 8, n_embd: int = 128,
                       timeout: float = 900) -> dict[str, Any]:
    """Measure the bubble of every schedule at every micro-batch count in one launch; table + chart."""
    check_options(nproc, microbatches, schedules, virtual_stages, n_layer)
    out_dir = Path(out_dir)
    spec = {"schedules": list(schedules), "microbatches": [int(m) for m in microbatches],
            "virtual_stages": virtual_stages, "steps": steps, "warmup": warmup, "block_size": block_size,
            "rows_per_microbatch": rows_per_microbatch, "n_layer": n_layer, "n_embd": n_embd, "n_head": 4,
            "vocab_size": 256}
    launch = run_workers(nproc, spec, out_dir, timeout, threads_per_rank(nproc), module="hftk.bench.pipeline_worker")
    result: dict[str, Any] = {
        "nproc": nproc, "virtual_stages": virtual_stages, "timed_steps": steps, "warmup_steps": warmup,
        "model": {k: spec[k] for k in ("n_layer", "n_embd", "n_head", "vocab_size", "block_size")},
        "rows_per_microbatch": rows_per_microbatch, "threads_per_rank": threads_per_rank(nproc),
        "machine": Machine.here().__dict__, "loadavg_before": launch.loadavg_before,
        "loadavg_after": launch.loadavg_after, "launch_wall_s": launch.wall_s,
        "rows": summarise(launch.ranks, nproc, virtual_stages),
    }
    timed = [r for r in result["rows"] if "skipped" not in r]
    result["max_abs_replay_minus_theory_pp"] = max(abs(r["replay_minus_theory_pp"]) for r in timed)
    result["max_abs_wall_minus_theory_pp"] = max(abs(r["wall_minus_theory_pp"]) for r in timed)
    result["replay_within_target"] = result["max_abs_replay_minus_theory_pp"] <= TARGET_PP
    finish(result, table, chart, out_dir / "pipeline_bubble.png")
    (out_dir / "pipeline.json").write_text(json.dumps(result, indent=1))
    return result
