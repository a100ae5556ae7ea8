"""What lets the suite and the set-up run on a GPU host, checked on any host: setup.sh refuses a
torch that does not see the GPU nvidia-smi lists, and scripts/gpu_check.sh (its no-GPU answer and its
summary of real metrics); the rank guard of every launch: tests/unit/test_gpu_readiness.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT, finetune, python, run


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


def test_gpu_check_fails_in_one_line_without_a_gpu_torch_can_use(tmp_path):
    """No GPU listed: it says so. On a GPU host the GPU is hidden from torch: it says torch sees none."""
    gpu_host = torch.cuda.is_available()
    result = run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path)], timeout=120,
                 env={"CUDA_VISIBLE_DEVICES": ""} if gpu_host else None)
    assert result.returncode == 1, result.output[-3000:]
    assert ("sees none" if gpu_host else "no NVIDIA GPU") in result.stderr, result.output[-3000:]
    assert not (tmp_path / "summary.md").exists()  # no run started


def _summary(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check_summary.py"), *map(str, args)],
                          capture_output=True, text=True)


@pytest.mark.slow
def test_gpu_check_summary_and_resume_verdict_on_real_runs(tmp_path):
    """gpu_check's two readings on the same flow it runs (here on this host's device): the table
    from metrics.jsonl, and the resume-with-dropout verdict (which must also catch a difference)."""
    import json
    import shutil

    run_args = ["--model_dropout", "0.1", "--max_train_samples", "300", "--max_steps", "4", "--save_strategy", "steps",
                "--save_steps", "2"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    finetune(1, [*run_args, "--output_dir", str(full)])
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    finetune(1, [*run_args, "--output_dir", str(resumed), "--resume_from_checkpoint", "latest"])

    table = _summary(tmp_path, "full", "absent").stdout.splitlines()
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert cells[0] == "full" and float(cells[1].replace(",", "")) > 0 and float(cells[3].replace(",", "")) > 0, table
    assert (cells[2] == "-") == (not torch.cuda.is_available()), table  # MFU needs a GPU's peak
    assert table[3] == "| absent | - | - | - | - |", table

    verdict = _summary("--resume", full, resumed)
    assert verdict.returncode == 0 and "steps 3-4 match" in verdict.stdout, verdict.stdout + verdict.stderr
    rows = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    (resumed / "metrics.jsonl").write_text("".join(json.dumps({**r, "loss": r["loss"] + 0.01} if "loss" in r else r)
                                                   + "\n" for r in rows))
    verdict = _summary("--resume", full, resumed)
    assert verdict.returncode == 1 and "DIFFER" in verdict.stdout, verdict.stdout


@pytest.mark.slow
def test_gpu_check_layouts_build_and_step_every_multi_rank_layout_on_one_device():
    """gpu_check's layout rows on this host's device, fp32: tp2 x fsdp2, cp2 x tp2, sp2 (fake process group,
    hftk's own layout code and mesh-loop step) and pp2 (hftk's 2-stage cut under torch's schedule), each
    row passing only with a finite loss, every parameter moved and the promised DTensor placements."""
    result = python([str(ROOT / "scripts" / "gpu_check_layouts.py"), "--dtypes", "fp32"], timeout=900)
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "fp32" in line]
    assert result.returncode == 0, result.output[-4000:]
    assert [r.split("|")[1].strip() for r in rows] == ["tp2 x fsdp2", "cp2 x tp2", "sp2", "pp2"], result.stdout
    assert all("| pass |" in r for r in rows), result.stdout
    assert "fake process group" in result.stdout


def test_gpu_check_mfu_line_from_metrics(tmp_path):
    """The throughput line: medians after the first (warm-up) window, the 45% goal, the recorded optimizer."""
    import json

    run_dir = tmp_path / "llama1b_bf16"
    run_dir.mkdir()
    rows = [{"step": 10, "tokens_per_s": 1000.0, "mfu": 0.05}, {"step": 20, "tokens_per_s": 40000.0, "mfu": 0.41},
            {"step": 30, "tokens_per_s": 42000.0, "mfu": 0.43}, {"step": 40, "tokens_per_s": 44000.0, "mfu": 0.47}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "hftk_run.json").write_text(json.dumps({"hyperparameters": {"optim": "adamw_torch_fused"}}))
    line = _summary("--mfu", run_dir).stdout.strip()
    assert line == ("throughput (llama1b_bf16): 42,000 tokens/s, MFU 43.0% of the dense bf16 peak; goal >= 45%: "
                    "not reached (optimizer: adamw_torch_fused)"), line
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({**r, "mfu": r["mfu"] + 0.1}) + "\n" for r in rows))
    assert "MFU 53.0% of the dense bf16 peak; goal >= 45%: reached" in _summary("--mfu", run_dir).stdout
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 10, "tokens_per_s": 5.0}) + "\n")
    assert "no MFU logged" in _summary("--mfu", run_dir).stdout


@pytest.mark.slow
def test_gpu_check_throughput_model_folder_trains_with_the_run_s_options(tmp_path):
    """The 1B run's code path at test size: gpu_check_model.py writes a Llama folder (config, bf16 weights,
    tokenizer) from a config, and hftk's entry point trains it with the throughput run's options; the
    optimizer asked for (equal to TrainingArguments' default, which load_config leaves out of
    cfg.training) is the one the Trainer records."""
    import json

    from transformers import AutoConfig

    folder = tmp_path / "llama"
    made = python([str(ROOT / "scripts" / "gpu_check_model.py"), str(folder), "--tiny"], timeout=300)
    assert made.returncode == 0, made.output[-3000:]
    config = AutoConfig.from_pretrained(folder)
    assert (config.model_type, config.num_key_value_heads, str(config.dtype)) == ("llama", 2, "torch.bfloat16")
    out = tmp_path / "out"
    finetune(1, ["--model_name_or_path", str(folder), "--attn_implementation", "sdpa", "--optim", "adamw_torch_fused",
                 "--block_size", "128", "--max_steps", "2", "--logging_steps", "1", "--output_dir", str(out)])
    record = json.loads((out / "hftk_run.json").read_text())
    assert record["hyperparameters"]["optim"] == "adamw_torch_fused", record["hyperparameters"]
    line = _summary("--mfu", out).stdout
    assert "no MFU logged" in line if not torch.cuda.is_available() else "MFU" in line, line
