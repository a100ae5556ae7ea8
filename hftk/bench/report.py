"""One report folder for any set of sub-benches: ``results.json``, ``summary.md``, the PNG charts.

Each bench ran in ``<report>/<name>/`` and left its charts there; its result dict may carry a
``table`` and a ``charts`` list (see :mod:`hftk.bench`). The summary states the machine and how
loaded it was, because on a shared machine every timing depends on it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from hftk.bench.launch import Machine


def write_report(report_dir: Path, results: dict[str, dict[str, Any]], machine: Machine, started: float,
                 command: str, failures: dict[str, str] | None = None) -> Path:
    """Write ``results.json`` and ``summary.md`` into ``report_dir``; returns the summary's path."""
    meta = {**dataclasses.asdict(machine), "loadavg_end": list(os.getloadavg()), "command": command,
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
            "duration_s": time.time() - started}
    payload = {"meta": meta, "benches": results, "failures": failures or {}}
    (report_dir / "results.json").write_text(json.dumps(payload, indent=1, default=_jsonable))
    summary = report_dir / "summary.md"
    summary.write_text(render_markdown(results, meta, failures or {}))
    return summary


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


def render_markdown(results: dict[str, dict[str, Any]], meta: dict[str, Any], failures: dict[str, str]) -> str:
    load = meta["loadavg_start"], meta["loadavg_end"]
    lines = [
        "# hftk bench report", "",
        f"- started {meta['started']}, took {meta['duration_s'] / 60:.1f} min; `{meta['command']}`",
        f"- device: {meta['device']} (x{max(meta['device_count'], 1)}), {meta['cpu_count']} CPU cores, torch {meta['torch']}",
        f"- load average (1, 5, 15 min) at start {_load(load[0])}, at end {_load(load[1])}"
        + (" - the machine was busy: timings are slower and noisier than on a quiet one." if
           max(load[0][0], load[1][0]) > meta["cpu_count"] * 0.5 else ""),
        "- figures are medians with [min-max] over repeats; raw numbers in `results.json`.", "",
    ]
    for name, result in results.items():
        lines += [f"## {name}", "", *markdown_table(result.get("table") or scalar_table(result)),
                  *[f"![{name}]({name}/{chart})" for chart in result.get("charts", [])], ""]
    for name, error in failures.items():
        lines += [f"## {name}: FAILED", "", "```", error.strip()[-3000:], "```", ""]
    return "\n".join(lines)


def _load(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def markdown_table(table: dict[str, Any]) -> list[str]:
    columns = table["columns"]
    return [f"**{table['title']}**", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(str(cell) for cell in row) + " |" for row in table["rows"]), ""]


def scalar_table(result: dict[str, Any]) -> dict[str, Any]:
    """For a bench that gave no table: its top-level numbers."""
    rows = [[k, f"{v:.4g}"] for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return {"title": "figures", "columns": ["figure", "value"], "rows": rows}


def numeric_leaves(value: Any, path: str = "") -> list[tuple[str, Any]]:
    """Every number (and every None) in a result, with its path: what 'all figures measured' checks."""
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in numeric_leaves(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [leaf for i, v in enumerate(value) for leaf in numeric_leaves(v, f"{path}[{i}]")]
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return [(path, value)]
    return []


def unmeasured(results: dict[str, Any]) -> list[str]:
    """Paths of figures that are None, NaN or infinite."""
    return [p for p, v in numeric_leaves(results) if v is None or not math.isfinite(v)]
