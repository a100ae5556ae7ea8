"""Bad input: one line naming the field, exit 2, no traceback, no process group (through the script, and
existing checkpoints never overwritten: tests/integration/test_errors.py)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import cpu_only_cases


@pytest.fixture()
def tiny_files(tmp_path):
    (tmp_path / "data.jsonl").write_text(json.dumps({"body": "some text here"}) + "\n")
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "bad.yaml").write_text("model:\n  model_name_or_path: [unclosed\n")
    (tmp_path / "section.yaml").write_text("modle:\n  model_name_or_path: x\n")
    (tmp_path / "misplaced.yaml").write_text("model:\n  block_size: 64\n")
    return tmp_path


CASES = [
    # (id, args, field named in the message)
    ("missing_model", ["--model_name_or_path", "./no/such/model"], "model.model_name_or_path"),
    ("unknown_builtin", ["--model_name_or_path", "builtin:nope"], "model.model_name_or_path"),
    ("unknown_column", ["--dataset", "{tmp}/data.jsonl"], "data.text_field"),
    ("block_too_big", ["--block_size", "4096"], "data.block_size"),
    ("zero_batch", ["--per_device_train_batch_size", "0"], "training.per_device_train_batch_size"),
    ("negative_accum", ["--gradient_accumulation_steps", "-1"], "training.gradient_accumulation_steps"),
    ("bad_lr", ["--learning_rate", "0"], "training.learning_rate"),
    ("unreadable_yaml", ["--config", "{tmp}/bad.yaml"], "--config"),
    ("missing_yaml", ["--config", "{tmp}/nope.yaml"], "--config"),
    ("unknown_section", ["--config", "{tmp}/section.yaml"], "config.modle"),
    ("misplaced_option", ["--config", "{tmp}/misplaced.yaml"], "model.block_size"),
    ("unknown_option", ["--blok_size", "64"], "--blok_size"),
    ("bad_choice", ["--strategy", "zero9"], "--strategy"),
    ("bad_type", ["--block_size", "big"], "--block_size"),
    ("bf16_and_fp16", ["--bf16", "--fp16"], "training.fp16"),
    *cpu_only_cases(("fp16_on_cpu", ["--fp16"], "training.fp16"), ("tf32_on_cpu", ["--tf32", "true"], "training.tf32")),
    ("empty_dataset", ["--dataset", "{tmp}/empty.txt"], "data.dataset"),
    ("missing_dataset", ["--dataset", "./no/such/file.txt"], "data.dataset"),
    ("bad_eval_fraction", ["--eval_fraction", "1.5"], "data.eval_fraction"),
    ("zero_eval_cap", ["--max_eval_samples", "0"], "data.max_eval_samples"),
    ("token_as_option", ["--hub_token", "hf_secret"], "training.hub_token"),
    ("push_without_repo", ["--push_to_hub"], "training.hub_model_id"),
    ("missing_resume", ["--resume_from_checkpoint", "{tmp}/nope"], "training.resume_from_checkpoint"),
]


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip() and "Setting accelerator" not in line]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("case_id,args,field", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line(case_id, args, field, tiny_files, capsys):
    """In-process (fast): exit code 2, one line naming the field and the fix, no process group, no output dir."""
    import torch.distributed as dist

    from hftk.run.prepare import main

    out = tiny_files / "out"
    args = [a.replace("{tmp}", str(tiny_files)) for a in args]
    assert main(["--output_dir", str(out), *args]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("hftk: error: ") and field in line, line
    assert "Fix:" in line
    assert not dist.is_initialized(), "validation must finish before any process group starts"
    assert not out.exists(), "a failed validation must not create or touch the output folder"
