"""`accelerate launch --num_processes 2` without a config file starts one process on a CPU machine: refused.

accelerate's simple launcher starts the script once without WORLD_SIZE, so only the launcher's
command line (hftk's parent) says that 2 were asked for.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hftk.engine.guard import accelerate_launch_args, check_accelerate_launch, requested_processes
from hftk.errors import HftkError
from tests.helpers import ROOT, TINY_ARGS, run

ACCELERATE = Path(sys.executable).with_name("accelerate")
SCRIPT = ["scripts/finetune.py", "--max_steps", "1"]


@pytest.mark.parametrize("argv, asked", [
    (["/v/bin/python3", "/v/bin/accelerate", "launch", "--num_processes", "2", *SCRIPT], 2),
    (["/v/bin/python3", "/v/bin/accelerate", "launch", "--num-processes=3", *SCRIPT], 3),  # accelerate's hyphen form
    (["/v/bin/python3", "/v/bin/accelerate", "launch", "--cpu", "--num_processes", "2", *SCRIPT], 2),
    (["/v/bin/python3", "/v/bin/accelerate-launch", "--num_machines", "2", *SCRIPT], 2),
    (["/v/bin/python3", "-m", "accelerate.commands.launch", "--num_processes", "4", *SCRIPT], 4),
    (["/v/bin/python3", "/v/bin/accelerate", "launch", *SCRIPT], 1),
    (["/v/bin/python3", "/v/bin/accelerate", "launch", *SCRIPT, "--num_processes", "2"], 1),  # the script's option
])
def test_the_request_is_read_with_accelerates_parser(argv, asked, monkeypatch, tmp_path):
    import accelerate.commands.config.config_args as config_args

    monkeypatch.setattr(config_args, "default_config_file", str(tmp_path / "none.yaml"))  # no user default config
    assert requested_processes(accelerate_launch_args(argv)) == asked


def test_a_config_file_that_starts_one_process_is_refused_too(tmp_path):
    """MULTI_CPU without mpirun: accelerate's simple launcher again (field notes)."""
    config = tmp_path / "multi_cpu.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\n"
                      "num_machines: 1\nmixed_precision: 'no'\nuse_cpu: true\n")
    argv = ["python", "accelerate", "launch", "--config_file", str(config), *SCRIPT]
    with pytest.raises(HftkError, match=r"asked for 2 processes.*--nproc_per_node 2"):
        check_accelerate_launch({}, argv)


def test_launches_that_start_their_ranks_pass():
    ddp = ["python", "accelerate", "launch", "--config_file", "accelerate_configs/ddp.yaml", *SCRIPT]
    check_accelerate_launch({"WORLD_SIZE": "2"}, ddp)  # torchrun underneath: the process group guard compares
    check_accelerate_launch({}, ["python", "-m", "torch.distributed.run", "--nproc_per_node", "2", *SCRIPT])
    check_accelerate_launch({}, ["bash"])  # not launched by accelerate at all


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
