"""``hftk bench startup``: a rank's time from process start to its first optimizer step, hftk against a
plain ``Trainer`` script, phase by phase.

That wait is paid at every launch and every elastic restart. Both variants train the same model on the
same text (the shipped corpus) with DDP under the same launcher (torchrun), 1 and 2 ranks, launched
alternately (hftk, plain, hftk, plain, ...) so load drifting on a shared machine hits both alike, after
one untimed launch of each (datasets' cache and the built-in model written, as for a user's second
launch). hftk is ``hftk train`` as a user starts it; its phases come from the run's own ``startup``
record (:mod:`hftk.core.startup`); the plain script is :mod:`hftk.bench.plain_trainer`, run by path so it
imports nothing from hftk. Rank 0's figures are compared (its first step waits for every rank's first
gradient all-reduce). The ratio hftk / plain > 1 means hftk starts slower.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hftk.bench.charts import figure, finish, fmt_spread, save
from hftk.bench.launch import BENCH_TRAIN_ARGS, threads_per_rank, torchrun_module
from hftk.bench.stats import spread
from hftk.core.startup import PHASES

VARIANTS = ("hftk", "plain")
PLAIN_SCRIPT = Path(__file__).with_name("plain_trainer.py")

OPTION_HELP = {
    "nprocs": "rank counts to measure (comma-separated)",
    "repeats": "interleaved (hftk, plain) launch pairs per rank count",
    "max_steps": "optimizer steps per launch (the first one is timed)",
}


def run_startup_bench(out_dir: Path, nprocs: list[int] = [1, 2], model: str = "builtin:gpt2-tiny",  # noqa: B006
                      block_size: int = 128, micro_batch: int = 4, max_steps: int = 2, repeats: int = 3,
                      train_args: list[str] | None = None, timeout: float = 600) -> dict[str, Any]:
    """``repeats`` interleaved pairs per rank count; each launch's rank 0 time to its first step, by phase."""
    from hftk.data.builtin import CORPUS, materialize_model

    out_dir = Path(out_dir)
    folder = materialize_model(model) if model.startswith("builtin:") else Path(model)
    runs = []
    for nproc in nprocs:
        for rep in range(-1, repeats):  # -1: the untimed launch of each variant
            for variant in VARIANTS:
                work = out_dir / f"{variant}-n{nproc}-r{rep}"
                record = work / "startup.json"
                if variant == "hftk":
                    target, args = "hftk.cli", ["train", *BENCH_TRAIN_ARGS, "--model_name_or_path", str(folder),
                                                "--dataset", str(CORPUS), "--block_size", str(block_size),
                                                "--per_device_train_batch_size", str(micro_batch), "--strategy",
                                                "ddp", "--max_steps", str(max_steps), "--output_dir", str(work / "run"),
                                                *(train_args or [])]
                    done = lambda work=work: _hftk_record(work) is not None  # noqa: E731
                else:
                    target, args = str(PLAIN_SCRIPT), [str(folder), str(CORPUS), str(record), "--block_size",
                                                       str(block_size), "--micro_batch", str(micro_batch),
                                                       "--max_steps", str(max_steps)]
                    done = record.exists
                launch = torchrun_module(nproc, target, args, work, timeout, threads_per_rank(max(nprocs)), done=done,
                                         real_torchrun=True)
                seconds = _hftk_record(work) if variant == "hftk" else json.loads(record.read_text())
                if rep >= 0:
                    runs.append({"variant": variant, "nproc": nproc, "repeat": rep, "seconds": seconds,
                                 "launch_wall_s": launch.wall_s, "loadavg_before": launch.loadavg_before})
    by = {(r["variant"], r["nproc"], r["repeat"]): r["seconds"] for r in runs}
    result: dict[str, Any] = {
        "model": model, "block_size": block_size, "micro_batch_per_rank": micro_batch, "repeats": repeats,
        "nprocs": nprocs, "runs": runs,
        "by_nproc": {str(n): {
            **{v: {phase: spread([by[v, n, i].get(phase, 0.0) for i in range(repeats)]) for phase in (*PHASES, "total")}
               for v in VARIANTS},
            # hftk's time to first step / the plain script's, per interleaved pair
            "ratio": spread([by["hftk", n, i]["total"] / by["plain", n, i]["total"] for i in range(repeats)]),
        } for n in nprocs},
    }
    return finish(result, table, chart, out_dir / "startup.png")


def _hftk_record(work: Path) -> dict[str, float] | None:
    """The ``startup`` record an hftk run wrote to its metrics file at its first step, or None yet."""
    path = work / "run" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return next((row["startup"] for row in rows if "startup" in row), None)


def table(result: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for n, figures in result["by_nproc"].items():
        for variant in VARIANTS:
            rows.append([n, variant, *(fmt_spread(figures[variant][p], 2) for p in (*PHASES, "total"))])
        rows.append([n, "hftk / plain", *([""] * len(PHASES)), fmt_spread(figures["ratio"], 3)])
    return {"title": f"Start-up: seconds from process start to the first optimizer step, rank 0 (DDP, torchrun; "
                     f"{result['repeats']} interleaved pairs; median [min-max])",
            "columns": ["ranks", "variant", *(p.replace("_", " ") for p in PHASES), "total"], "rows": rows}


def chart(result: dict[str, Any], path: Path) -> str:
    fig, axes = figure(len(result["by_nproc"]), "Time to first optimizer step, by phase (median)")
    for ax, (n, figures) in zip(axes, result["by_nproc"].items()):
        bottom = [0.0, 0.0]
        for phase in PHASES:
            heights = [figures[v][phase]["median"] for v in VARIANTS]
            ax.bar(VARIANTS, heights, bottom=bottom, label=phase.replace("_", " "))
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set(title=f"{n} rank(s)", ylabel="seconds")
    axes[-1].legend(fontsize=7)
    return save(fig, path)
