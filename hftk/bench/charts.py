"""Shared chart and table formatting for the bench modules (matplotlib, Agg: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)


def figure(ncols: int, title: str) -> tuple[Any, list[Any]]:
    fig, axes = plt.subplots(1, ncols, figsize=(4.2 * ncols, 3.4), squeeze=False)
    fig.suptitle(title, fontsize=10)
    return fig, list(axes[0])


def save(fig: Any, path: Path) -> str:
    """Write a compact PNG (well under 300 KB) and return its file name."""
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path.name


def finish(result: dict[str, Any], table: Callable[[dict[str, Any]], dict[str, Any]],
           chart: Callable[[dict[str, Any], Path], str], path: Path) -> dict[str, Any]:
    """A bench's result with the ``table`` and ``charts`` the report shows (:mod:`hftk.bench`)."""
    result["table"] = table(result)
    result["charts"] = [chart(result, path)]
    return result


def whiskers(spreads: list[dict[str, float]]) -> tuple[list[float], list[list[float]]]:
    """Medians and their distances down to the min and up to the max (matplotlib's asymmetric ``yerr``)."""
    return ([s["median"] for s in spreads],
            [[s["median"] - s["min"] for s in spreads], [s["max"] - s["median"] for s in spreads]])


def errorbar(ax: Any, xs: list[float], spreads: list[dict[str, float]], label: str, **kw: Any) -> None:
    """Medians with min-max whiskers."""
    med, err = whiskers(spreads)
    ax.errorbar(xs, med, yerr=err, label=label, **{"marker": "o", "capsize": 4, **kw})


def fmt_spread(s: dict[str, float] | None, digits: int = 1) -> str:
    """``median [min-max]`` for a table cell."""
    return "-" if s is None else f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"
