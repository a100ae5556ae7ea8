"""Where a rank's start-up goes: seconds from process start to the end of its first optimizer step.

That wait is what a user pays at every launch and every elastic restart. The engines close each phase
with :func:`mark` as they go; the first optimizer step closes the last one. Process start comes from
the kernel (psutil), so the interpreter's start and every import before hftk's entry point count as
``imports``; a phase an entry point does not mark (a bench worker has no ``imports`` mark) is folded
into the next one marked. Leaf module: imports nothing from hftk.
"""

from __future__ import annotations

import time

import psutil

PHASES = ("imports", "prepare", "process_group", "data", "model", "trainer", "first_step")
_ends: dict[str, float] = {}


def mark(phase: str) -> None:
    """Close ``phase`` now (its first mark counts: a later run in the same process changes nothing)."""
    assert phase in PHASES, phase
    _ends.setdefault(phase, time.time())


def report() -> dict[str, float]:
    """Seconds per marked phase, in order, and ``total`` (process start to the last mark)."""
    start = previous = psutil.Process().create_time()
    seconds = {}
    for phase in PHASES:
        if phase in _ends:
            seconds[phase] = round(_ends[phase] - previous, 3)
            previous = _ends[phase]
    return {**seconds, "total": round(previous - start, 3)}


def elapsed() -> float:
    """Seconds since this process started (the kernel's clock: imports included)."""
    return time.time() - psutil.Process().create_time()


def line(seconds: dict[str, float]) -> str:
    """``hftk: first optimizer step 11.7 s after process start (imports 6.9 s, ...)``."""
    parts = ", ".join(f"{phase.replace('_', ' ')} {s:.1f} s" for phase, s in seconds.items() if phase != "total")
    return f"hftk: first optimizer step {seconds['total']:.1f} s after process start ({parts})"
