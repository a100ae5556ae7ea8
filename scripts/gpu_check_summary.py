"""The table of scripts/gpu_check.sh: per run, median tokens/s and MFU (first logging window left
out: it holds CUDA warm-up / compilation), peak memory and the last loss, from each run's metrics.jsonl.

usage: python scripts/gpu_check_summary.py WORK_DIR RUN_NAME...   (WORK_DIR/RUN_NAME/metrics.jsonl)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def _steady(values: list[float]) -> list[float]:
    return values[1:] or values


def row(name: str, metrics: Path) -> str:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    speed = _steady([r["tokens_per_s"] for r in rows if "tokens_per_s" in r])
    mfu = _steady([r["mfu"] for r in rows if "mfu" in r])
    peak = [r["peak_mem_mb_max"] for r in rows if "peak_mem_mb_max" in r]
    loss = [r["loss"] for r in rows if "loss" in r]
    cells = [f"{statistics.median(speed):,.0f}" if speed else "-",
             f"{100 * statistics.median(mfu):.1f}%" if mfu else "-",
             f"{max(peak):,.0f}" if peak else "-",
             f"{loss[-1]:.3f}" if loss else "-"]
    return f"| {name} | " + " | ".join(cells) + " |"


def main(argv: list[str]) -> None:
    work, names = Path(argv[0]), argv[1:]
    print("| run | tokens/s | MFU | peak memory MiB | last loss |\n|---|---|---|---|---|")
    for name in names:
        print(row(name, work / name / "metrics.jsonl"))


if __name__ == "__main__":
    main(sys.argv[1:])
