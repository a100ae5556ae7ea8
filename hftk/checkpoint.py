"""Finding checkpoints: ``checkpoint-N`` folders under the output dir, newest complete first."""

from __future__ import annotations

import re
from pathlib import Path

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
COMPLETE_MARKER = "trainer_state.json"  # the Trainer writes it after weights and optimizer state


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest to newest by step."""
    if not Path(output_dir).is_dir():
        return []
    found = []
    for child in Path(output_dir).iterdir():
        match = CHECKPOINT_RE.match(child.name)
        if match and child.is_dir() and (child / COMPLETE_MARKER).exists():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def resolve_resume(output_dir: Path, value: str | None) -> str | None:
    """``latest`` -> newest complete checkpoint (or None to start fresh); a path passes through."""
    if not value:
        return None
    if value == "latest":
        checkpoints = list_checkpoints(output_dir)
        return str(checkpoints[-1]) if checkpoints else None
    return value
