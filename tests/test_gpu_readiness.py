"""What lets the suite and the set-up run on a GPU host, checked on any host: setup.sh refuses a
torch that does not see the GPU nvidia-smi lists, the shared rank guard of every multi-process
launch, and scripts/gpu_check.sh (its no-GPU answer and its summary of real metrics)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT, finetune, require_ranks, run


def _fake_nvidia_smi(folder):
    fake = folder / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    fake.chmod(0o755)
    return f"{folder}:{os.environ['PATH']}"


def test_setup_refuses_a_torch_that_does_not_see_the_listed_gpu(tmp_path):
    """nvidia-smi is a script listing one GPU; CUDA_VISIBLE_DEVICES="" hides any real one, so a CUDA
    build on a GPU host is refused here just as a CPU wheel is. Nothing is installed before the check."""
    result = run(["bash", str(ROOT / "scripts" / "setup.sh")], timeout=300,
                 env={"PATH": _fake_nvidia_smi(tmp_path), "CUDA_VISIBLE_DEVICES": ""})
    lines = [line for line in result.stderr.splitlines() if line.startswith("setup:")]
    assert result.returncode != 0, result.output[-3000:]
    assert len(lines) == 1 and "lists 1 GPU(s)" in lines[0] and "sees none" in lines[0], result.output[-3000:]


def test_launches_skip_only_where_a_gpu_host_lacks_a_gpu_per_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    require_ranks(8)  # CPU-only host: gloo runs any number of ranks
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    require_ranks(1)
    with pytest.raises(pytest.skip.Exception, match="needs 2 GPUs .*this host has 1"):
        require_ranks(2)


def test_gpu_check_fails_in_one_line_without_a_gpu_torch_can_use(tmp_path):
    """No GPU listed: it says so. On a GPU host the GPU is hidden from torch: it says torch sees none."""
    gpu_host = torch.cuda.is_available()
    result = run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path)], timeout=120,
                 env={"CUDA_VISIBLE_DEVICES": ""} if gpu_host else None)
    assert result.returncode == 1, result.output[-3000:]
    assert ("sees none" if gpu_host else "no NVIDIA GPU") in result.stderr, result.output[-3000:]
    assert not (tmp_path / "summary.md").exists()  # no run started


@pytest.mark.slow
def test_gpu_check_summary_reads_a_real_runs_metrics(tmp_path):
    out = tmp_path / "run"
    finetune(1, ["--max_train_samples", "300", "--max_steps", "4", "--logging_steps", "2", "--output_dir", str(out)])
    table = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check_summary.py"), str(tmp_path), "run",
                            "absent"], capture_output=True, text=True, check=True).stdout.splitlines()
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert cells[0] == "run" and all(c != "-" for c in (cells[1], cells[3], cells[4])), table
    assert float(cells[1].replace(",", "")) > 0 and float(cells[3].replace(",", "")) > 0, table
    assert (cells[2] == "-") == (not torch.cuda.is_available()), table  # MFU needs a GPU's peak
    assert table[3] == "| absent | - | - | - | - |", table
