"""Config loading (hftk.config): YAML sections and command-line overrides, every TrainingArguments field
passed through, help text on every option."""

from __future__ import annotations

import dataclasses

from hftk.config import SECTIONS, build_parser, load_config


def test_yaml_sections_and_cli_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model: {model_name_or_path: builtin:gpt2-tiny}\n"
        "data: {block_size: 32}\n"
        "training: {learning_rate: 0.01, per_device_train_batch_size: 3}\n"
        "strategy: {strategy: ddp}\n"
    )
    cfg = load_config(["--config", str(path), "--block_size", "48"])
    assert cfg.model.model_name_or_path == "builtin:gpt2-tiny"
    assert cfg.data.block_size == 48  # command line wins over the file
    assert cfg.training["learning_rate"] == 0.01 and cfg.training["per_device_train_batch_size"] == 3
    assert load_config(cfg_args := ["--config", str(path)]).data.block_size == 32, cfg_args


def test_every_training_argument_passes_through():
    cfg = load_config(["--adam_beta2", "0.95", "--weight_decay", "0.1", "--optim", "adamw_torch"])
    assert cfg.training["adam_beta2"] == 0.95 and cfg.training["weight_decay"] == 0.1
    assert cfg.training["optim"] == "adamw_torch"


def test_every_option_has_help_text():
    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            assert len(f.metadata.get("help", "")) > 10, f"{cls.__name__}.{f.name} has no help"
    help_text = build_parser().format_help()
    assert "--strategy" in help_text and "--block_size" in help_text and "--learning_rate" in help_text
