"""The table of scripts/gpu_check.sh: per run, median tokens/s and MFU (first logging window left
out: it holds CUDA warm-up / compilation), peak memory and the last loss, from each run's metrics.jsonl.

usage: python scripts/gpu_check_summary.py WORK_DIR RUN_NAME...   (WORK_DIR/RUN_NAME/metrics.jsonl)
       python scripts/gpu_check_summary.py --resume FULL_DIR RESUMED_DIR
           (the resumed run's losses against the uninterrupted run's at the same steps; exit 1 if apart)
       python scripts/gpu_check_summary.py --mfu RUN_DIR
           (the throughput run's line: tokens/s, MFU against the goal, the optimizer the run recorded)
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


# Dropout on: a generator restored wrongly changes the masks and the loss by ~1e-2; GPU kernels
# without deterministic algorithms (atomic adds in backward) may differ by far less than this.
RESUME_TOLERANCE = 1e-3


def losses(folder: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def resume_verdict(full: Path, resumed: Path) -> tuple[bool, str]:
    """Whether the resumed run's losses equal the uninterrupted run's at every step it logged."""
    before, after = losses(full), losses(resumed)
    if not after or not set(after) <= set(before):
        return False, f"resume: resumed steps {sorted(after)} not among the full run's {sorted(before)}"
    diff = max(abs(after[s] - before[s]) for s in after)
    ok = diff <= RESUME_TOLERANCE
    return ok, (f"resume with dropout: steps {min(after)}-{max(after)} {'match' if ok else 'DIFFER'}, "
                f"max |loss difference| {diff:.2e} (tolerance {RESUME_TOLERANCE:g})")


MFU_GOAL = 0.45  # issue 16: bf16 at world size 1 (torchtitan: 33-39% for Llama-3.1-8B on 8 x H100 with FSDP)


def mfu_line(run: Path) -> str:
    """The throughput run's medians (first window left out) and whether MFU reaches the goal."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] \
        if (run / "metrics.jsonl").exists() else []
    mfu = _steady([r["mfu"] for r in rows if "mfu" in r])
    speed = _steady([r["tokens_per_s"] for r in rows if "tokens_per_s" in r])
    record = run / "hftk_run.json"
    optim = json.loads(record.read_text())["hyperparameters"].get("optim", "?") if record.exists() else "?"
    if not mfu:
        return f"throughput ({run.name}): no MFU logged (run failed, or no GPU peak known for this device)"
    value = statistics.median(mfu)
    verdict = "reached" if value >= MFU_GOAL else "not reached"
    return (f"throughput ({run.name}): {statistics.median(speed):,.0f} tokens/s, MFU {100 * value:.1f}% of the "
            f"dense bf16 peak; goal >= {100 * MFU_GOAL:.0f}%: {verdict} (optimizer: {optim})")


def main(argv: list[str]) -> None:
    if argv[0] == "--mfu":
        print(mfu_line(Path(argv[1])))
        return
    if argv[0] == "--resume":
        ok, line = resume_verdict(Path(argv[1]), Path(argv[2]))
        print(line)
        sys.exit(0 if ok else 1)
    work, names = Path(argv[0]), argv[1:]
    print("| run | tokens/s | MFU | peak memory MiB | last loss |\n|---|---|---|---|---|")
    for name in names:
        print(row(name, work / name / "metrics.jsonl"))


if __name__ == "__main__":
    main(sys.argv[1:])
