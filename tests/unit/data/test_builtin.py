"""The built-in model cache: written before any process group, an incomplete cached folder named, not
loaded (a rank inside a process group: tests/integration/test_builtin.py)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hftk.core.errors import HftkError
from hftk.data.builtin import WEIGHTS, materialize_model

NAME = "builtin:gpt2-tiny"


def test_prepare_writes_a_builtin_before_any_process_group(builtin_cache, tmp_path):
    from hftk.run.prepare import prepare

    prepare(["--model_name_or_path", NAME, "--output_dir", str(tmp_path / "out")])
    folders = list((builtin_cache / "models").iterdir())
    assert [f.name.split("-")[:2] for f in folders] == [["gpt2", "tiny"]]  # no temporary folder left behind
    assert (folders[0] / "config.json").is_file() and (folders[0] / WEIGHTS).is_file()
    assert not dist.is_initialized()


def test_an_incomplete_cached_folder_is_named_not_loaded(builtin_cache):
    folder = materialize_model(NAME)
    (folder / WEIGHTS).unlink()
    with pytest.raises(HftkError, match=f"lacks {WEIGHTS} .*Fix: delete {folder}"):
        materialize_model(NAME)
