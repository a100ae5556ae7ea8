"""The run record and model card (hftk/checkpoint/run_record.py): what trained, how, with which objective."""

from __future__ import annotations

from hftk.checkpoint.run_record import model_card, run_record
from hftk.config.options import load_config


def _record(argv: list[str], tmp_path) -> dict:
    cfg = load_config(["--output_dir", str(tmp_path), *argv])
    return run_record(cfg, cfg.args, 2, "preference", 4, {"eval_loss": 0.5})


def test_a_dpo_run_says_dpo_with_its_beta_and_loss_type(tmp_path) -> None:
    record = _record(["--method", "dpo", "--beta", "0.3", "--loss_type", "ipo"], tmp_path)
    assert {k: record["hyperparameters"][k] for k in ("method", "beta", "loss_type")} == \
        {"method": "dpo", "beta": 0.3, "loss_type": "ipo"}
    card = model_card(record, None)
    assert "- method: **DPO** (Direct Preference Optimization, TRL's DPOTrainer), beta 0.3, loss ipo" in card
    assert "- dpo\n" in card.split("---")[1]  # a tag of the card's metadata
    assert "| beta | 0.3 |" in card and "| loss_type | ipo |" in card


def test_a_supervised_run_names_no_preference_options(tmp_path) -> None:
    record = _record([], tmp_path)
    assert not {"method", "beta", "loss_type"} & set(record["hyperparameters"])
    card = model_card(record, None)
    assert "DPO" not in card and "- dpo\n" not in card


def test_a_grpo_run_says_grpo_with_its_rewards_and_group(tmp_path) -> None:
    record = _record(["--method", "grpo", "--reward_funcs", "r.py:exact,think_format_reward", "--num_generations",
                      "4", "--beta", "0.04"], tmp_path)
    hyper = record["hyperparameters"]
    assert {k: hyper[k] for k in ("method", "beta", "loss_type", "reward_funcs", "num_generations",
                                  "max_completion_length")} == {
        "method": "grpo", "beta": 0.04, "loss_type": "dapo", "reward_funcs": "r.py:exact,think_format_reward",
        "num_generations": 4, "max_completion_length": 512}
    card = model_card(record, None)
    assert ("- method: **GRPO** (Group Relative Policy Optimization, TRL's GRPOTrainer), rewards "
            "`r.py:exact,think_format_reward`, 4 completions per prompt, beta 0.04, loss dapo") in card
    assert "- grpo\n" in card.split("---")[1]
