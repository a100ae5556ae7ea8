"""Gradient-compression options and state (hftk.comm.register) in one process: bad options refused before
any process group, missing state on resume named."""

from __future__ import annotations

import pytest
import torch

from hftk.comm.register import load_state
from hftk.config.options import load_config
from hftk.core.errors import HftkError
from hftk.run.validate import check_config


def test_missing_state_on_resume_is_a_clear_error(tmp_path):
    with pytest.raises(HftkError, match="no gradient-compression state for rank 1"):
        load_state(None, tmp_path, 1, torch.device("cpu"))


BAD = [
    (["--grad_compression", "topk", "--strategy", "zero2"], "strategy.grad_compression"),
    (["--hierarchical_allreduce", "true", "--strategy", "fsdp"], "strategy.hierarchical_allreduce"),
    (["--grad_compression", "powersgd", "--powersgd_rank", "0"], "strategy.powersgd_rank"),
    (["--grad_compression", "powersgd", "--powersgd_warmup_steps", "-1"], "strategy.powersgd_warmup_steps"),
    (["--grad_compression", "topk", "--topk_ratio", "1.5"], "strategy.topk_ratio"),
    (["--grad_compression", "topk", "--topk_ratio", "0"], "strategy.topk_ratio"),
    (["--grad_compression", "topk", "--topk_warmup_steps", "-2"], "strategy.topk_warmup_steps"),
]


@pytest.mark.parametrize("args,field", BAD, ids=[f for _, f in BAD])
def test_bad_compression_options_are_rejected_before_any_process_group(args, field, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(HftkError) as err:
        check_config(load_config(["--output_dir", str(tmp_path / "out"), *args]))
    assert err.value.field == field and "\n" not in str(err.value)


def test_compression_needs_two_processes_and_node_info(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(HftkError, match="at least two processes"):
        check_config(load_config(["--output_dir", str(tmp_path), "--grad_compression", "fp16"]))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("GROUP_RANK", raising=False)
    with pytest.raises(HftkError, match="GROUP_RANK and LOCAL_WORLD_SIZE"):
        check_config(load_config(["--output_dir", str(tmp_path), "--hierarchical_allreduce", "true"]))
