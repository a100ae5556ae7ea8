"""Generated launch configs: ``hftk configs`` writes other layouts and refuses a bad one in one line, a
contradiction stops a real run before anything starts. That each shipped YAML really starts two gloo ranks
reading its strategy is test_plan's (its ``measured`` fixture launches every one)."""

from __future__ import annotations

import os

import pytest

from tests.helpers import ROOT, python
from tests.unit.launch.test_configs import CONFIGS, _deepspeed_env


def test_configs_command_writes_other_layouts(tmp_path):
    out = tmp_path / "cfg"
    result = python(["-m", "hftk.cli", "configs", "--out", str(out), "--procs_per_node", "4"], timeout=120)
    assert result.returncode == 0, result.output
    import yaml

    zero3 = yaml.safe_load((out / "zero3.yaml").read_text())
    assert zero3["num_processes"] == 4
    assert zero3["deepspeed_config"]["deepspeed_config_file"] == str(out / "deepspeed" / "zero3.json")
    assert (out / "deepspeed" / "zero3.json").read_text() == (CONFIGS / "deepspeed" / "zero3.json").read_text()


@pytest.mark.parametrize("args,field", [(["--nodes", "2"], "--main_process_ip"), (["--nodes", "0"], "--nodes"),
                                        (["--procs_per_node", "0"], "--procs_per_node")])
def test_configs_command_bad_layout_is_one_line(args, field, tmp_path):
    result = python(["-m", "hftk.cli", "configs", "--out", str(tmp_path / "c"), *args], timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip() and "Setting accelerator" not in line]
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"hftk: error: {field}"), result.stderr
    assert not (tmp_path / "c").exists()


def test_contradiction_stops_a_real_run_before_anything_starts(tmp_path):
    """Through finetune.py: exit 2, one line, nothing written."""
    out = tmp_path / "out"
    env = {**os.environ, **_deepspeed_env("zero3")}
    result = python([str(ROOT / "scripts" / "finetune.py"), "--output_dir", str(out), "--strategy",
                  "fsdp"], timeout=120, env=env)
    lines = [line for line in result.stderr.splitlines() if line.strip() and "Setting accelerator" not in line]
    assert result.returncode == 2 and len(lines) == 1 and "strategy.strategy" in lines[0], result.stderr
    assert not out.exists()
