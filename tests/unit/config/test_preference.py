"""Preference options: TRL's own loss types, the YAML's training.method, values checked, every strategy decides."""

from __future__ import annotations

import dataclasses

import pytest

from hftk.config import support
from hftk.config.options import DPO_LOSS_TYPES, load_config
from hftk.core.errors import HftkError
from hftk.run.validate import check_config


def test_loss_types_are_trls() -> None:
    from trl import DPOConfig

    help_text = next(f for f in dataclasses.fields(DPOConfig) if f.name == "loss_type").metadata["help"]
    offered = {part.split("'")[0] for part in help_text.split("`'")[1:]}
    assert set(DPO_LOSS_TYPES) == offered


def test_yaml_training_method_and_cli(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("training:\n  method: dpo\n  beta: 0.3\n  learning_rate: 1.0e-4\n")
    cfg = load_config(["--config", str(path), "--loss_type", "ipo"])
    assert (cfg.preference.method, cfg.preference.beta, cfg.preference.loss_type) == ("dpo", 0.3, "ipo")
    assert "method" not in cfg.training and cfg.to_dict()["training"]["method"] == "dpo"


@pytest.mark.parametrize("argv, field", [
    (["--beta", "0"], "training.beta"),
    (["--beta", "-1"], "training.beta"),
    (["--max_length", "0"], "training.max_length"),
    (["--method", "dpo", "--lora_r", "8", "--ref_model_name_or_path", "x"], "training.ref_model_name_or_path"),
])
def test_bad_values_name_the_field(argv, field) -> None:
    with pytest.raises(HftkError) as info:
        check_config(load_config(argv))
    assert info.value.field == field


def test_every_strategy_decides_on_dpo() -> None:
    assert set(support.DPO_REFUSED) | set(support.DPO_STRATEGIES) == set(support.STRATEGIES)
    for strategy in support.DPO_REFUSED:
        with pytest.raises(HftkError, match=f"strategy {strategy}"):
            support.check_method(strategy, "dpo")
        support.check_method(strategy, "sft")


def test_dpo_with_lora_is_refused_where_the_adapter_is_sharded() -> None:
    for strategy in support.DPO_STRATEGIES:
        support.check_method(strategy, "dpo", 0)
        if strategy in support.DPO_LORA_REFUSED:
            with pytest.raises(HftkError, match=f"DPO with LoRA is not supported with strategy {strategy}") as info:
                support.check_method(strategy, "dpo", 8)
            assert info.value.field == "model.lora_r"
        else:
            support.check_method(strategy, "dpo", 8)
    assert set(support.DPO_LORA_REFUSED) == {"fsdp", "zero3", "zero3_offload"}
