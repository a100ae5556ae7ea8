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


def _dpo_main(tmp_path, *argv: str) -> int:
    import json

    from hftk.run.prepare import main
    from tests.helpers import TINY_ARGS

    data = tmp_path / "prefs.jsonl"
    data.write_text(json.dumps({"prompt": "Say hi:", "chosen": " hi", "rejected": " no"}) + "\n")
    return main([*TINY_ARGS, "--method", "dpo", "--dataset", str(data), "--output_dir", str(tmp_path / "out"), *argv])


@pytest.mark.parametrize("reference, problem", [
    ("other_vocab", "other_vocab' has a vocabulary of 1000 tokens, the model trained (builtin:gpt2-tiny) 2048"),
    ("/nonexistent/reference", "/nonexistent/reference"),
])
def test_a_reference_that_cannot_score_the_policys_tokens_is_one_line_before_launch(tmp_path, capsys, reference,
                                                                                   problem) -> None:
    from transformers import GPT2Config

    GPT2Config(vocab_size=1000, n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path / "other_vocab")
    code = _dpo_main(tmp_path, "--ref_model_name_or_path", str(tmp_path / reference) if reference == "other_vocab"
                     else reference)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("hftk: error: training.ref_model_name_or_path: ") and problem in err[0], err[0]
    assert not (tmp_path / "out").exists()


def test_a_reference_with_the_policys_vocabulary_passes_the_check() -> None:
    from hftk.models.loading import load_model_config
    from hftk.run.validate import check_reference

    cfg = load_config(["--method", "dpo", "--model_name_or_path", "builtin:gpt2-tiny",
                       "--ref_model_name_or_path", "builtin:gpt2-tiny4"])
    check_reference(cfg, load_model_config(cfg.model))


def test_precomputed_log_probs_are_refused_by_the_support_table_under_fsdp_only() -> None:
    with pytest.raises(HftkError) as info:
        support.check_method("fsdp", "dpo", 0, precompute_ref_log_probs=True)
    assert info.value.field == "training.precompute_ref_log_probs" and "strategy fsdp" in info.value.problem
    for strategy in ("ddp", "zero1", "zero2", "zero3", "zero3_offload"):
        support.check_method(strategy, "dpo", 0, precompute_ref_log_probs=True)


def test_grpo_loss_types_and_method_defaults_are_trls() -> None:
    from trl import DPOConfig, GRPOConfig

    from hftk.config.options import GRPO_LOSS_TYPES, METHOD_DEFAULTS

    help_text = next(f for f in dataclasses.fields(GRPOConfig) if f.name == "loss_type").metadata["help"]
    offered = set(help_text.split("Supported values are ", 1)[1].split(". ")[0].replace("and ", "").replace("'", "")
                  .replace(" ", "").split(","))
    assert set(GRPO_LOSS_TYPES) == offered
    for method, config in (("dpo", DPOConfig), ("grpo", GRPOConfig)):
        trl = {f.name: f.default for f in dataclasses.fields(config)}
        trl["loss_type"] = trl["loss_type"] if isinstance(trl["loss_type"], str) else "sigmoid"  # DPO: a list field
        assert METHOD_DEFAULTS[method] == {k: trl[k] for k in METHOD_DEFAULTS[method]}, method


def test_unset_beta_and_loss_type_mean_each_methods_default() -> None:
    assert (load_config(["--method", "grpo"]).preference.beta, load_config(["--method", "grpo"]).preference.loss_type) \
        == (0.0, "dapo")
    assert (load_config(["--method", "dpo"]).preference.beta, load_config([]).preference.loss_type) == (0.1, "sigmoid")
    cfg = load_config(["--method", "grpo", "--reward_funcs", "a.py:f,b.py:g", "--reward_funcs", "c.py:h"])
    assert cfg.rl.reward_funcs == ["c.py:h"]  # the last given wins, as for every option
    assert load_config(["--method", "grpo", "--reward_funcs", "a.py:f,b.py:g"]).rl.reward_funcs == ["a.py:f", "b.py:g"]
