"""DeepSpeed ZeRO in one process (hftk.strategies.deepspeed): the DeepSpeed config follows the typed
config, bad combinations and offload without a toolchain are one line before launch, the engine check,
and which folder a resume at another world size loads (the universal checkpoint, or one line)."""

from __future__ import annotations

import json
import re
import shutil
from types import SimpleNamespace

import pytest
import torch

from hftk.core.errors import HftkError
from tests.helpers import TINY_ARGS, cpu_only_cases
from tests.unit.run.test_validate import sealed_by


def test_deepspeed_config_follows_the_typed_config():
    from hftk.config.options import load_config
    from hftk.strategies.deepspeed import deepspeed_config

    for strategy, stage in (("zero1", 1), ("zero2", 2), ("zero3", 3), ("zero3_offload", 3)):
        ds = deepspeed_config(load_config(["--strategy", strategy, "--max_grad_norm", "0.3"]))
        zero = ds["zero_optimization"]
        assert zero["stage"] == stage and zero["overlap_comm"] is False
        assert ds["gradient_clipping"] == 0.3  # explicit: DeepSpeed alone would clip at 1.0
        assert zero["reduce_bucket_size"] == "auto"  # h^2, filled by the Trainer from the model
        assert ds["bf16"]["enabled"] == ds["fp16"]["enabled"] == "auto" and ds["fp16"]["loss_scale"] == 0
        assert ds["train_micro_batch_size_per_gpu"] == ds["gradient_accumulation_steps"] == "auto"
        assert ("stage3_prefetch_bucket_size" in zero) == (stage == 3)
        assert zero.get("stage3_gather_16bit_weights_on_model_save", False) == (stage == 3)
        offload = strategy == "zero3_offload"
        assert ("offload_optimizer" in zero) == ("offload_param" in zero) == ("optimizer" in ds) == offload
    json.dumps(ds)  # what `hftk configs` writes


def test_verify_refuses_a_model_that_is_not_a_deepspeed_engine():
    from hftk.config.options import load_config
    from hftk.strategies.deepspeed import deepspeed_config, verify

    trainer = SimpleNamespace(args=SimpleNamespace(deepspeed=deepspeed_config(load_config(["--strategy", "zero3"]))),
                              model_wrapped=torch.nn.Linear(2, 2))
    with pytest.raises(HftkError, match="ZeRO-3 was asked for but the Trainer wrapped the model as Linear"):
        verify(trainer)


def test_use_cpu_is_refused_only_where_it_would_drop_deepspeed(monkeypatch):
    from hftk.config.options import load_config
    from hftk.strategies import deepspeed

    monkeypatch.setenv("LOCAL_RANK", "0")
    cfg = load_config(["--strategy", "zero3", "--use_cpu", "true"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    deepspeed.validate(cfg, 2)  # no GPU: hftk runs DeepSpeed on the CPU with use_cpu anyway
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(HftkError, match="training.use_cpu"):
        deepspeed.validate(cfg, 2)


BAD = [
    # (id, extra args, field named in the one-line error)
    ("fsdp_offload_with_zero", ["--strategy", "zero2", "--fsdp_cpu_offload"], "strategy.fsdp_cpu_offload"),
    ("hybrid_with_zero", ["--strategy", "zero3", "--fsdp_hybrid"], "strategy.fsdp_hybrid"),
    *cpu_only_cases(("fp16_on_cpu", ["--strategy", "zero3", "--fp16"], "training.fp16")),
    ("ddp_hook_with_zero", ["--strategy", "zero1", "--grad_compression", "fp16"], "strategy.grad_compression"),
    ("own_deepspeed_json", ["--strategy", "zero2", "--deepspeed", "ds.json"], "training.deepspeed"),
    ("sgd_with_offload", ["--strategy", "zero3_offload", "--optim", "sgd"], "training.optim"),
    ("no_launcher", ["--strategy", "zero3"], "launch"),
    ("unknown_strategy", ["--config", "{tmp}/zero9.yaml"], "strategy.strategy"),
]


@pytest.mark.parametrize("case_id,args,field", BAD, ids=[c[0] for c in BAD])
def test_bad_combinations_are_one_line_errors(case_id, args, field, tmp_path, capsys, monkeypatch):
    from hftk.run.prepare import main

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    (tmp_path / "zero9.yaml").write_text("strategy:\n  strategy: zero9\n")
    out = tmp_path / "out"
    code = main([*TINY_ARGS, "--output_dir", str(out), *(a.replace("{tmp}", str(tmp_path)) for a in args)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"hftk: error: {field}: ") and "Fix:" in err[0], err[0]
    assert not out.exists()


def test_offload_without_a_toolchain_is_one_line_before_launch(tmp_path, monkeypatch):
    """DeepSpeed JIT-builds CPU Adam at the first step of zero3_offload: a machine without the
    tools hears what to install before any rank starts, not minutes later in a compiler log."""
    from hftk.config.options import load_config
    from hftk.strategies import deepspeed as ds

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built yet
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    cfg = load_config(["--strategy", "zero3_offload"])
    with pytest.raises(HftkError) as refused:
        ds.validate(cfg, 1)
    line = refused.value.one_line()
    assert refused.value.field == "strategy.strategy" and "C++ compiler" in line and "ninja" in line, line
    ds.validate(load_config(["--strategy", "zero3"]), 1)  # no offload: nothing to build
    (tmp_path / "cpu_adam").mkdir(exist_ok=True)
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")  # built once: no tools needed any more
    ds.validate(cfg, 1)


def test_only_a_zero_resume_at_another_world_size_loads_the_universal_folder(tmp_path, monkeypatch):
    """A checkpoint-5.universal left by an earlier 2 -> 1 resume must not be read by a resume at the saved
    world size (its DeepSpeed config then lacks load_universal), nor for a checkpoint that is not ZeRO's."""
    from hftk.strategies.deepspeed import resume_folder

    folder = sealed_by(tmp_path / "run" / "checkpoint-5", world=2, global_batch=4)
    (folder / "latest").write_text("global_step5")
    (folder / "global_step5").mkdir()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert resume_folder(str(folder)) == str(tmp_path / "run" / "checkpoint-5.universal")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resume_folder(str(folder)) == str(folder)
    (folder / "latest").unlink()  # not a DeepSpeed checkpoint (e.g. ddp's): nothing to convert
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert resume_folder(str(folder)) == str(folder)


def test_a_zero_checkpoint_deepspeed_cannot_convert_fails_in_one_line_and_leaves_nothing_beside_it(tmp_path):
    from hftk.strategies.deepspeed import to_universal

    folder = sealed_by(tmp_path / "run" / "checkpoint-5", world=2, global_batch=4)
    (folder / "latest").write_text("global_step5")
    (folder / "global_step5").mkdir()  # no ZeRO shards in it
    with pytest.raises(HftkError, match=rf"DeepSpeed could not convert {re.escape(str(folder))}/global_step5 to a "
                                        r"universal checkpoint: .* Fix: resume with the number of ranks that saved it"):
        to_universal(folder)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-5"]


def test_lora_with_added_chat_tokens_under_zero3_is_refused_without_a_gpu(monkeypatch):
    """PEFT's trainable tokens gather the new rows on a CUDA device under ZeRO-3: on CPU the run would crash
    in every rank's get_peft_model; named before launch instead, with the two ways out."""
    from hftk.config.options import load_config
    from hftk.strategies import deepspeed as ds

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    chat = [*TINY_ARGS, "--strategy", "zero3", "--chat_template", "chatml"]
    with pytest.raises(HftkError) as refused:
        ds.validate(load_config([*chat, "--lora_r", "4"]), 2)
    assert refused.value.field == "data.add_chat_tokens" and "--no_add_chat_tokens" in refused.value.one_line()
    ds.validate(load_config([*chat, "--lora_r", "4", "--no_add_chat_tokens"]), 2)
    ds.validate(load_config(chat), 2)  # full fine-tuning: transformers' resize gathers on any device
    ds.validate(load_config([*chat, "--lora_r", "4", "--strategy", "zero2"]), 2)  # not partitioned
