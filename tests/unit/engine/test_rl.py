"""GRPO's engine pieces that need no process group: GRPOConfig's fields from hftk's options (set ones only, TRL's
names; the rollouts' temperature and top_p always), and the final mean reward the run record and last line read."""

from __future__ import annotations

from types import SimpleNamespace

from hftk.config.options import load_config
from hftk.engine.rl import final_reward, grpo_options


def test_options_left_unset_keep_trls_defaults() -> None:
    options = grpo_options(load_config(["--method", "grpo", "--reward_funcs", "r.py:f"]))
    assert options == {"beta": 0.0, "loss_type": "dapo", "temperature": 1.0, "top_p": 1.0,
                       "mask_truncated_completions": False, "use_vllm": False, "reward_weights": None,
                       "log_completions": False}


def test_options_set_reach_grpo_config_under_trls_names() -> None:
    from trl import GRPOConfig

    cfg = load_config(["--method", "grpo", "--reward_funcs", "r.py:f", "--num_generations", "4",
                       "--max_completion_length", "64", "--epsilon", "0.1", "--epsilon_high", "0.28",
                       "--num_iterations", "2", "--scale_rewards", "batch", "--importance_sampling_level", "sequence",
                       "--mask_truncated_completions", "--temperature", "0.7", "--top_p", "0.9", "--beta", "0.04",
                       "--loss_type", "grpo", "--reward_weights", "0.5"])
    options = grpo_options(cfg)
    fields = {f for f in GRPOConfig.__dataclass_fields__}
    assert set(options) <= fields
    assert {k: options[k] for k in ("num_generations", "max_completion_length", "epsilon", "epsilon_high",
                                    "num_iterations", "scale_rewards", "importance_sampling_level",
                                    "mask_truncated_completions", "temperature", "top_p", "beta", "loss_type",
                                    "reward_weights")} == {
        "num_generations": 4, "max_completion_length": 64, "epsilon": 0.1, "epsilon_high": 0.28, "num_iterations": 2,
        "scale_rewards": "batch", "importance_sampling_level": "sequence", "mask_truncated_completions": True,
        "temperature": 0.7, "top_p": 0.9, "beta": 0.04, "loss_type": "grpo", "reward_weights": [0.5]}


def test_the_final_reward_is_the_last_logged_one() -> None:
    history = [{"step": 2, "reward": 0.1}, {"step": 4, "reward": 0.3, "loss": 0.0}, {"step": 4, "train_loss": 0.0}]
    assert final_reward(SimpleNamespace(state=SimpleNamespace(log_history=history))) == \
        {"train_reward": 0.3, "train_reward_step": 4}
    assert final_reward(SimpleNamespace(state=SimpleNamespace(log_history=[]))) == {}
