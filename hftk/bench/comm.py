"""``hftk bench comm``: every gradient-compression hook side by side, in one launch.

One DDP replica per hook trains from the same weights on the same batches, the hooks taking turns
step by step (see :mod:`hftk.bench.comm_worker`), so load on a shared machine falls on all of them
alike. Per hook: step time, communication share of the step, bytes each rank sends per step and the
ratio to an fp32 all-reduce, and the loss after N steps. Communication time comes from the hooks'
own counters (the union of the intervals in which a collective was in flight:
:mod:`hftk.comm.accounting`), and the *exposed* part (hooks blocked on a collective, plus
communication still in flight after the last bucket was handed over); never from subtracting a
``no_sync`` run, whose difference drowns in the noise. Warm-up steps (uncompressed, for PowerSGD and
top-k) and the first steps are not timed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hftk.bench.charts import figure, finish, fmt_spread, save
from hftk.bench.launch import DEFAULT_MODEL, Machine, threads_per_rank, torchrun_module
from hftk.bench.stats import percent, spread

HOOKS = ("none", "fp16", "bf16", "powersgd", "topk")
OPTION_HELP = {
    "nproc": "ranks (DDP replicas of each hook)",
    "model": "model every hook trains (Hub id, folder or builtin:NAME)",
    "steps": "optimizer steps per hook, warm-up included",
    "bucket_cap_mb": "DDP bucket size in MB",
    "warmup_steps": "uncompressed steps before PowerSGD and top-k compress (not timed)",
    "powersgd_rank": "PowerSGD rank",
    "topk_ratio": "top-k: fraction of the entries sent",
    "hooks": "comma-separated hooks to compare (none = hftk's fp32 all-reduce hook)",
    "timeout": "seconds before the launch is killed",
}


def run_comm_bench(out_dir: Path, nproc: int = 2, model: str = DEFAULT_MODEL, steps: int = 30,
                   block_size: int = 128, micro_batch: int = 8, bucket_cap_mb: float = 25.0,
                   warmup_steps: int = 5, powersgd_rank: int = 4, topk_ratio: float = 0.01,
                   hooks: tuple[str, ...] = HOOKS, timeout: float = 1200) -> dict[str, Any]:
    """Launch one interleaved run of ``hooks`` on ``nproc`` ranks; summarise, tabulate and chart it.
    ``warmup_steps`` uncompressed steps start PowerSGD and top-k; timing starts two steps later."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    job = {"name": "bench", "model": model, "hooks": list(hooks), "steps": steps, "block_size": block_size,
           "batch": micro_batch, "bucket_cap_mb": bucket_cap_mb, "powersgd_rank": powersgd_rank,
           "powersgd_warmup_steps": warmup_steps, "topk_ratio": topk_ratio, "topk_warmup_steps": warmup_steps,
           "interleave": True}
    first_timed = warmup_steps + 2
    if steps <= first_timed:
        raise ValueError(f"steps must exceed warmup_steps + 2 = {first_timed} to time compressed steps")
    machine = Machine.here()
    plan_path, out_path = out_dir / "plan.json", out_dir / "raw.json"
    plan_path.write_text(json.dumps({"jobs": [job]}, indent=1))
    launch = torchrun_module(nproc, "hftk.bench.comm_worker", ["--plan", str(plan_path), "--out", str(out_path)],
                             out_dir, timeout, threads_per_rank(nproc))
    raw = json.loads(out_path.read_text())
    result: dict[str, Any] = {
        "nproc": nproc, "model": model, "params": raw[0]["params"], "steps": steps, "timed_steps": steps - first_timed,
        "block_size": block_size, "micro_batch_per_rank": micro_batch, "bucket_cap_mb": bucket_cap_mb,
        "warmup_steps": warmup_steps, "powersgd_rank": powersgd_rank, "topk_ratio": topk_ratio,
        "threads_per_rank": threads_per_rank(nproc), "launch_wall_s": launch.wall_s, "machine": machine.__dict__,
        "loadavg_before": launch.loadavg_before, "loadavg_after": launch.loadavg_after,
        "hooks": {r["hook"]: summarise(r, first_timed) for r in raw},
    }
    (out_dir / "comm.json").write_text(json.dumps(result, indent=1))
    return finish(result, table, chart, out_dir / "comm.png")


def summarise(run: dict[str, Any], first_timed: int) -> dict[str, Any]:
    """Medians (with spread) over the timed steps of one hook's records (rank 0's view)."""
    timed = run["records"][first_timed:]
    arrival_timed = "comm_time_s" in timed[0]  # absent on NCCL (see hftk.comm.accounting): shares left None
    return {
        "step_time_s": spread([r["wall_s"] for r in timed]),
        "cpu_time_s": spread([r["cpu_s"] for r in timed]),
        "comm_share": spread([r["comm_time_s"] / r["wall_s"] for r in timed]) if arrival_timed else None,
        "exposed_comm_share": spread([r["exposed_comm_s"] / r["wall_s"] for r in timed]) if arrival_timed else None,
        **{k: timed[-1][f"comm_{k}"]
           for k in ("bytes_per_step", "compression_ratio", "collectives_per_step", "buckets")},
        "final_train_loss": run["records"][-1]["loss"],
        "eval_loss": run["eval_loss"],
        "losses": [r["loss"] for r in run["records"]],
    }


def table(result: dict[str, Any]) -> dict[str, Any]:
    rows = [[hook, fmt_spread(s["step_time_s"], 3), fmt_spread(percent(s["comm_share"])),
             fmt_spread(percent(s["exposed_comm_share"])), f"{s['bytes_per_step'] / 2**20:.3f}",
             f"{s['compression_ratio']:.1f}x", f"{s['eval_loss']:.3f}"] for hook, s in result["hooks"].items()]
    load = f"load avg {result['loadavg_before'][0]:.1f} -> {result['loadavg_after'][0]:.1f}"
    if any(s["comm_share"] is None for s in result["hooks"].values()):
        load += "; comm % not measured: NCCL futures complete on enqueue"
    return {"title": f"Gradient compression, {result['model']} ({result['params'] / 1e6:.1f}M params), "
                     f"{result['nproc']} ranks, {result['timed_steps']} timed steps of {result['steps']} "
                     f"({result['machine']['device']}, {load})",
            "columns": ["hook", "step time s", "comm in flight % of step", "comm exposed % of step",
                        "MiB sent / rank / step", "vs fp32 all-reduce", f"eval loss after {result['steps']} steps"],
            "rows": rows}


def chart(result: dict[str, Any], path: Path) -> str:
    stats = result["hooks"]
    hooks = list(stats)
    fig, (time_ax, bytes_ax, loss_ax) = figure(3, f"Gradient compression, {result['model']}, {result['nproc']} ranks")
    xs = range(len(hooks))
    share = {h: (stats[h]["comm_share"] or {"median": 0.0})["median"] for h in hooks}  # 0: not timed (NCCL)
    exposed_share = {h: (stats[h]["exposed_comm_share"] or {"median": 0.0})["median"] for h in hooks}
    exposed = [stats[h]["step_time_s"]["median"] * exposed_share[h] for h in hooks]
    hidden = [stats[h]["step_time_s"]["median"] * max(0.0, share[h] - exposed_share[h]) for h in hooks]
    rest = [stats[h]["step_time_s"]["median"] - e - hd for h, e, hd in zip(hooks, exposed, hidden)]
    time_ax.bar(xs, rest, label="compute")
    time_ax.bar(xs, hidden, bottom=rest, label="comm overlapped")
    time_ax.bar(xs, exposed, bottom=[r + hd for r, hd in zip(rest, hidden)], label="comm exposed")
    time_ax.set(xticks=list(xs), xticklabels=hooks, ylabel="median step time (s)")
    time_ax.legend(fontsize=7)
    bytes_ax.bar(xs, [stats[h]["bytes_per_step"] / 2**20 for h in hooks])
    bytes_ax.set(yscale="log", xticks=list(xs), xticklabels=hooks, ylabel="MiB sent per rank per step (log)")
    for h in hooks:
        loss_ax.plot(range(1, len(stats[h]["losses"]) + 1), stats[h]["losses"], label=h)
    loss_ax.set(xlabel="step", ylabel="training loss")
    loss_ax.legend(fontsize=7)
    return save(fig, path)
