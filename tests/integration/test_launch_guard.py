"""`accelerate launch --num_processes 2` without a config file starts one process on a CPU machine: refused.

accelerate's simple launcher starts the script once without WORLD_SIZE, so only the launcher's
command line (hftk's parent) says that 2 were asked for.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, TINY_ARGS, run

ACCELERATE = Path(sys.executable).with_name("accelerate")


@pytest.mark.slow
def test_accelerate_num_processes_2_without_config_is_refused_before_anything_starts(tmp_path):
    out = tmp_path / "run"
    result = run([str(ACCELERATE), "launch", "--num_processes", "2", "scripts/finetune.py", *TINY_ARGS,
                  "--max_steps", "1", "--output_dir", str(out)], timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith("hftk: error:")]
    assert errors == [
        "hftk: error: launch: `accelerate launch` was asked for 2 processes but started this one alone (its simple "
        "launcher: no config file, --cpu or MULTI_CPU on a machine without GPUs); it would train alone on the full "
        "data. Fix: launch with `accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 "
        "scripts/finetune.py` or `torchrun --nproc_per_node 2 scripts/finetune.py`; on CPU never use "
        "`accelerate launch --cpu`."], result.stderr[-3000:]
    # the script exited 2; accelerate reports that with its own CalledProcessError (its only traceback)
    assert "returned non-zero exit status 2." in result.stderr and result.returncode != 0
    assert result.stderr.count("Traceback") == 1 and "hftk/" not in result.stderr.split("Traceback", 1)[1]
    assert not out.exists()  # nothing written


@pytest.mark.slow
def test_a_single_process_accelerate_launch_still_trains(tmp_path):
    out = tmp_path / "run"
    result = run([str(ACCELERATE), "launch", "scripts/finetune.py", *TINY_ARGS, "--max_steps", "1",
                  "--output_dir", str(out)], timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.output[-5000:]
    assert json.loads((out / "hftk_run.json").read_text())["world_size"] == 1
