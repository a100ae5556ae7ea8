"""Telemetry that needs processes of its own: ZeRO-3's partitioned parameters counted whole in the FLOPs
per token (2 ranks), the peak-memory window in a fresh process."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import ROOT, free_port, python


@pytest.mark.slow
def test_flops_per_token_counts_zero3_partitioned_parameters_whole():
    """Under ZeRO-3 every rank holds 0 elements of each parameter; MFU must still count the full model."""
    import json

    result = python([str(ROOT / "tests" / "workers" / "zero3_flops.py")], timeout=600,
                 env={"MASTER_PORT": str(free_port())})
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("FLOPS ")), None)
    assert result.returncode == 0 and line, result.output[-4000:]
    counts = json.loads(line[len("FLOPS "):])
    assert counts["local_elements"] == 0, counts  # really partitioned
    assert counts["partitioned"] == counts["whole"], counts


PEAK_WINDOW = """
import torch
from hftk.telemetry.rank_monitor import peak_memory_bytes, reset_peak_memory

cpu = torch.device("cpu")
assert reset_peak_memory(cpu)
before = peak_memory_bytes(cpu)
block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
assert peak_memory_bytes(cpu) >= before + 60 * 2**20, (before, peak_memory_bytes(cpu))
del block
assert reset_peak_memory(cpu)
assert peak_memory_bytes(cpu) < before + 60 * 2**20
"""


def test_peak_memory_window_resets_and_sees_a_big_allocation():
    """In a fresh process: in this one, an earlier test (tokenising a 5 MB row) leaves free heap
    memory still resident, which a new 64 MiB block can reuse without raising the resident set."""
    import subprocess

    result = subprocess.run([sys.executable, "-c", PEAK_WINDOW], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
