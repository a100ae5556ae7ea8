"""``hftk bench memory``: what each strategy really holds per rank, side by side in one run, and
how close the memory plan (:mod:`hftk.plan.estimate`) came.

Every strategy trains the same model for a few steps through hftk's own engine
(:mod:`hftk.bench.memory_worker`), one launch after another. Like every hftk run the workers tell
glibc to hand freed memory back (:mod:`hftk.core.allocator`): with its defaults glibc keeps 0.9-1.2 GiB
of freed heap resident and RSS hides what sharding saves (field notes). Per rank: the training
phase's peak and the counted bytes of parameters, gradients and optimizer state (how:
:mod:`hftk.bench.memory_worker`; loading and imports come before the peak, as ``lifetime_peak_mib``),
beside the plan's prediction of both for the same model, batch and world size.

With ``--lora_r R`` every strategy also runs with LoRA adapters of rank R, and with ``--load_in_4bit``
on a 4-bit (QLoRA) base too, as rows ``STRATEGY lora`` / ``STRATEGY qlora`` beside full fine-tuning. With
``--dpo`` every strategy that trains DPO also runs it (row ``STRATEGY dpo``) on generated preference pairs of
the same token length: the frozen reference model counted as the rank holds it (whole, 16-bit or sharded)
beside the plan's reference row, and the peak and the median step time (after the first step) as ratios to
the same strategy's supervised run, measured in this run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hftk.bench.charts import figure, finish, save
from hftk.bench.launch import BENCH_TRAIN_ARGS, threads_per_rank, torchrun_module
from hftk.bench.loss import markdown_rows as loss_rows
from hftk.bench.loss import run_loss_rows
from hftk.bench.report import markdown_table
from hftk.core import allocator
from hftk.core.errors import HftkError
from hftk.plan.estimate import MIB, PLAN_STRATEGIES, StrategyPlan

DEFAULT_MODEL = "builtin:gpt2-90m"
SHARDED_TARGET = 0.65  # fsdp and zero3 peak at most this fraction of ddp's (issue 3)
PLAN_TARGET = 0.25  # the plan's peak within this fraction of the measured one
# Rows that are a layout of strategy tp / cp (hftk's custom loop): the hftk train options of each.
MESH_ROWS = {
    "tp": lambda nproc: ["--strategy", "tp", "--tp_size", str(nproc)],
    "tp_fsdp": lambda nproc: ["--strategy", "tp", "--tp_size", "2", "--dp_shard_size", "-1"],
    # The CPU ring attention has no dropout kernel: cp trains without dropout (its memory is not counted anyway).
    "cp": lambda nproc: ["--strategy", "cp", "--cp_size", str(nproc), "--model_dropout", "0"],
}

OPTION_HELP = {
    "nproc": "processes (ranks) of every run",
    "steps": "optimizer steps per run (the second is counted)",
    "strategies": "comma-separated strategies, run in this order (also tp: TP over all ranks; tp_fsdp: TP=2 x "
                  "FSDP2 over the rest, 4 ranks or more; cp: ring-attention context parallel over all ranks)",
    "lora_r": "also run every strategy with LoRA adapters of this rank (row 'STRATEGY lora'; 0: full fine-tuning only)",
    "load_in_4bit": "with lora_r: also run every strategy on a 4-bit (nf4, double-quantized) base (row 'STRATEGY qlora')",
    "loss_vocab": "also measure the loss, plain against chunked, on one rank of a Qwen2-shaped model with this "
                  "vocabulary (e.g. 151936; 0: off), beside a 2,048-token twin as the baseline",
    "loss_tokens": "comma-separated sequence lengths of the loss rows (default 2048,8192)",
    "dpo": "also run every strategy that trains DPO with --method dpo (row 'STRATEGY dpo'): its reference model "
           "counted and planned, its peak against the same strategy's supervised run",
}


def variants(lora_r: int, load_in_4bit: bool, pairs: Path | None = None) -> dict[str, list[str]]:
    """Row suffix -> hftk train options: full fine-tuning, then LoRA, then QLoRA, then DPO on ``pairs`` (as asked)."""
    rows = {"": []}
    if lora_r:
        rows[" lora"] = ["--lora_r", str(lora_r)]
        if load_in_4bit:
            rows[" qlora"] = ["--lora_r", str(lora_r), "--load_in_4bit"]
    if pairs is not None:
        rows[" dpo"] = ["--method", "dpo", "--dataset", str(pairs), "--eval_fraction", "0", "--truncation", "truncate"]
    return rows


def preference_pairs(path: Path, block_size: int) -> Path:
    """Pairs whose prompt + completion fill ``block_size`` tokens of the built-in tokenizers or more (the DPO row
    runs with --truncation truncate: TRL cuts them to max_length = block_size): DPO's batches then hold as many
    tokens per sequence as the supervised rows."""
    words = "blue cat dog moon lamp rock".split()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(256):
            w, o = words[i % 6], words[(i + 1) % 6]
            f.write(json.dumps({"prompt": f"Repeat {w}:", "chosen": f" {w}" * block_size,
                                "rejected": f" {o}" * block_size}) + "\n")
    return path


def run_memory_bench(out_dir: Path, nproc: int = 2, model: str = DEFAULT_MODEL, block_size: int = 64,
                     micro_batch: int = 2, steps: int = 3, strategies: tuple[str, ...] = PLAN_STRATEGIES,
                     train_args: list[str] | None = None, timeout: float = 900, lora_r: int = 0,
                     load_in_4bit: bool = False, dpo: bool = False, loss_vocab: int = 0,
                     loss_tokens: list[int] | None = None) -> dict[str, Any]:
    """Run every strategy once at ``nproc`` ranks (and with LoRA / QLoRA / DPO when asked, and the loss rows of
    :mod:`hftk.bench.loss` with ``loss_vocab``); write ``memory.md``, ``memory.png`` and ``memory.json``."""
    from hftk.config.support import DPO_STRATEGIES

    out_dir = Path(out_dir)
    argv = [*BENCH_TRAIN_ARGS, "--model_name_or_path", model, "--block_size", str(block_size),
            "--per_device_train_batch_size", str(micro_batch), "--max_steps", str(steps),
            "--comm_profile_steps", "0", *(train_args or [])]  # the timed step's span lists would count
    runs: dict[str, Any] = {}
    load_before = list(os.getloadavg())
    pairs = preference_pairs(out_dir / "pairs.jsonl", block_size) if dpo else None
    for suffix, extra in variants(lora_r, load_in_4bit, pairs).items():
        rows = [s for s in strategies if suffix != " dpo" or s in DPO_STRATEGIES]
        predictions = predict([*argv, *extra], nproc, tuple(rows))
        for strategy in rows:
            work = out_dir / (strategy + suffix.replace(" ", "_"))
            record = work / "memory.json"
            layout = MESH_ROWS[strategy](nproc) if strategy in MESH_ROWS else ["--strategy", strategy]
            launch = torchrun_module(nproc, "hftk.bench.memory_worker",
                                     [*argv, *extra, *layout, "--output_dir", str(work / "run"), "--memory_out",
                                      str(record)], work, timeout, threads_per_rank(nproc))
            runs[strategy + suffix] = summarise(json.loads(record.read_text()), predictions[strategy], launch.wall_s)
            runs[strategy + suffix]["step_time_s"] = step_time(work / "run" / "metrics.jsonl")
    result: dict[str, Any] = {
        "model": model, "nproc": nproc, "block_size": block_size, "micro_batch": micro_batch, "steps": steps,
        "allocator": allocator.effective(), "loadavg_before": load_before, "loadavg_after": list(os.getloadavg()),
        "strategies": runs,
    }
    if "ddp" in runs:
        for run in runs.values():
            run["peak_vs_ddp"] = run["peak_mib"] / runs["ddp"]["peak_mib"]
        result["targets"] = {s: runs[s]["peak_vs_ddp"] <= SHARDED_TARGET for s in ("fsdp", "zero3") if s in runs}
    for name, run in runs.items():  # DPO beside the same strategy's supervised run, both measured here
        if name.endswith(" dpo") and name.removesuffix(" dpo") in runs:
            sft = runs[name.removesuffix(" dpo")]
            run["peak_vs_sft"] = run["peak_mib"] / sft["peak_mib"]
            run["step_time_vs_sft"] = run["step_time_s"] / sft["step_time_s"]
    if loss_vocab:
        result["loss"] = run_loss_rows(out_dir, BENCH_TRAIN_ARGS + ["--comm_profile_steps", "0"], loss_vocab,
                                       tuple(loss_tokens or (2048, 8192)), steps, timeout, predict, step_time)
    result["plan_within_target"] = {s: abs(r["plan_peak_error"]) <= PLAN_TARGET for s, r in runs.items()}
    result["plan_model_state_within_10pct"] = {s: abs(r["plan_model_state_error"]) <= 0.1 for s, r in runs.items()}
    finish(result, table, chart, out_dir / "memory.png")
    (out_dir / "memory.json").write_text(json.dumps(result, indent=1))
    (out_dir / "memory.md").write_text(markdown(result))
    return result


def step_time(metrics_file: Path) -> float:
    """The run's median step time after its first step (one-time work), from its metrics.jsonl."""
    import statistics

    from hftk.telemetry.metrics import read_jsonl

    times = [r["step_time_s"] for r in read_jsonl(metrics_file) if "loss" in r and r.get("step", 0) >= 2]
    if not times:
        raise HftkError("memory.steps", f"{metrics_file} logged no step after the first.", "run 2 steps or more.")
    return statistics.median(times)


def predict(argv: list[str], nproc: int, strategies: tuple[str, ...]) -> dict[str, StrategyPlan]:
    """The plan for exactly these runs: same config (dtype, LoRA, batch, ...), world size ``nproc``."""
    from hftk.config.options import load_config
    from hftk.models.loading import load_model_config
    from hftk.plan.estimate import estimate, inputs_from_config, model_shape

    cfg = load_config(argv)
    model_config = load_model_config(cfg.model)
    shape = model_shape(model_config, cfg.model.lora_r, cfg.model.lora_target_modules)
    inputs = inputs_from_config(cfg, nproc, budget=0)
    return {s: estimate_mesh(s, model_config, shape, inputs) if s in MESH_ROWS else estimate(s, shape, inputs)
            for s in strategies}


def estimate_mesh(name: str, model_config: Any, shape: Any, inputs: Any) -> StrategyPlan:
    from hftk.strategies.tensor import estimate_memory
    from hftk.strategies.tp_plans import replicated_params

    tp, cp = {"cp": (1, inputs.world_size), "tp": (inputs.world_size, 1)}.get(name, (2, 1))  # else tp_fsdp
    return estimate_memory(shape, inputs, tp, replicated_params(model_config), cp=cp)


def check_options(strategies: tuple[str, ...] = PLAN_STRATEGIES, nproc: int = 2, **_: Any) -> None:
    """Bad input fails before any launch: unknown strategies, a TP x FSDP row without room for both."""
    from hftk.config import strategy_table as known

    for name in [s for s in strategies if s not in MESH_ROWS]:
        known.get(name)
    if "tp_fsdp" in strategies and (nproc < 4 or nproc % 2):
        raise HftkError("--nproc", f"the tp_fsdp row needs an even number of ranks, 4 or more (got {nproc}).",
                        "pass --nproc 4, or leave tp_fsdp out.")


def summarise(record: dict[str, Any], plan: StrategyPlan, wall_s: float) -> dict[str, Any]:
    """The worst rank's figures (what has to fit), the plan's, and their difference."""
    ranks = record["ranks"]
    peak = max(r["peak"] for r in ranks)
    state = max(r["total"] for r in ranks)
    return {
        "world_size": record["world_size"], "wall_s": wall_s,
        "peak_mib": peak / MIB, "peak_per_rank_mib": [r["peak"] / MIB for r in ranks],
        "lifetime_peak_mib": max(r["lifetime_peak"] for r in ranks) / MIB,
        "model_state_mib": state / MIB,
        "counted": {k: max(r[k] for r in ranks) / MIB for k in ("params", "grads", "optimizer")},
        "reference_mib": max(r.get("reference", 0) for r in ranks) / MIB, "plan_reference_mib": plan.reference / MIB,
        "plan_model_state_mib": plan.model_state / MIB, "plan_peak_mib": plan.device_total / MIB,
        "plan_model_state_error": plan.model_state / state - 1, "plan_peak_error": plan.device_total / peak - 1,
    }


def table(result: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for name, r in result["strategies"].items():
        c = r["counted"]
        rows.append([name, f"{r['peak_mib']:.0f}", f"{r['peak_vs_ddp']:.3f}" if "peak_vs_ddp" in r else "-",
                     f"{r['model_state_mib']:.1f}", f"{c['params']:.1f} / {c['grads']:.1f} / {c['optimizer']:.1f}",
                     f"{r['plan_model_state_mib']:.1f}", f"{r['plan_model_state_error']:+.1%}", f"{r['plan_peak_mib']:.0f}",
                     f"{r['plan_peak_error']:+.0%}",
                     f"{r['reference_mib']:.1f} / {r['plan_reference_mib']:.1f}" if r["plan_reference_mib"] else "-",
                     f"{r['peak_vs_sft']:.2f}" if "peak_vs_sft" in r else "-",
                     f"{r['step_time_vs_sft']:.2f}" if "step_time_vs_sft" in r else "-"])
    return {"title": f"per-rank memory, {result['model']}, {result['nproc']} ranks, micro-batch "
                     f"{result['micro_batch']} x {result['block_size']} tokens, training-phase peak (malloc tuned)",
            "columns": ["strategy", "peak MiB (max rank)", "x ddp", "model state MiB", "params / grads / optim MiB",
                        "plan model state MiB", "plan model state error", "plan peak MiB", "plan peak error",
                        "DPO reference MiB (counted / plan)", "DPO peak x SFT", "DPO step time x SFT"],
            "rows": rows}


def chart(result: dict[str, Any], path: Path) -> str:
    runs = result["strategies"]
    names = list(runs)
    fig, (ax,) = figure(1, f"per-rank memory at {result['nproc']} ranks ({result['model']})")
    fig.set_size_inches(7.5, 3.6)
    xs = range(len(names))
    series = [("measured peak", "peak_mib"), ("plan peak", "plan_peak_mib"), ("counted model state", "model_state_mib")]
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series):
        ax.bar([x + (i - 1) * width for x in xs], [runs[n][key] for n in names], width, label=label)
    if "ddp" in runs:
        ax.axhline(SHARDED_TARGET * runs["ddp"]["peak_mib"], color="gray", linestyle="--", linewidth=1,
                   label=f"{SHARDED_TARGET} x ddp peak")
    ax.set(xticks=list(xs), xticklabels=names, ylabel="MiB per rank")
    ax.legend(fontsize=7)
    return save(fig, path)


def markdown(result: dict[str, Any]) -> str:
    load = ", ".join(f"{v:.1f}" for v in result["loadavg_before"])
    allocated = " ".join(f"{k}={v}" for k, v in result["allocator"].items())
    return "\n".join([*markdown_table(result["table"]), *(loss_rows(result["loss"]) if "loss" in result else []),
                      f"Load average (1, 5, 15 min) before the runs: {load}. "
                      f"Allocator: {allocated}.", "", "![memory](memory.png)", ""])
