"""`accelerate launch --num_processes 2` without a config file starts one process on a CPU machine: refused.

accelerate's simple launcher starts the script once without WORLD_SIZE, so only the launcher's
command line (hftk's parent) says that 2 were asked for.
"""

from __future__ import annotations

import pytest

from hftk.core.errors import HftkError
from hftk.launch.guard import accelerate_launch_args, check_accelerate_launch, requested_processes

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
