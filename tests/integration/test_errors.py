"""Bad input through scripts/finetune.py in a process of its own: one line naming the field, exit 2; existing
checkpoints are never overwritten."""

from __future__ import annotations

import pytest

from tests.helpers import FINETUNE, python
from tests.unit.core.test_errors import _one_error_line


@pytest.mark.parametrize("args,field", [(["--blok_size", "64"], "--blok_size"),
                                        (["--block_size", "4096"], "data.block_size")])
def test_bad_input_through_the_script(args, field, tmp_path):
    """The real entry point: exit status 2, a single line, no traceback."""
    result = python([str(FINETUNE), "--output_dir", str(tmp_path / "out"), *args], timeout=120)
    assert result.returncode == 2, result.output
    assert field in _one_error_line(result.stderr)
    assert "Traceback" not in result.output


def test_existing_checkpoints_are_never_overwritten(tmp_path):
    out = tmp_path / "out"
    ckpt = out / "checkpoint-3"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    before = sorted(p.name for p in out.rglob("*"))
    result = python([str(FINETUNE), "--output_dir", str(out)], timeout=120)
    assert result.returncode == 2 and "training.output_dir" in result.stderr
    assert "--resume_from_checkpoint latest" in result.stderr
    assert sorted(p.name for p in out.rglob("*")) == before
