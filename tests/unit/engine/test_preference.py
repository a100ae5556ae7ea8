"""The DPO engine's arguments (hftk/engine/preference.py), in process: an option a run leaves unset means
under ``--method dpo`` what it means under sft, not TRL's DPOConfig default."""

from __future__ import annotations

from hftk.config.options import load_config
from hftk.engine.preference import trl_default_overrides


def _dpo_config(argv: list[str], tmp_path):
    from trl import DPOConfig

    cfg = load_config(["--method", "dpo", "--output_dir", str(tmp_path), *argv])
    return DPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], **trl_default_overrides(cfg)), cfg


def test_unset_options_keep_hftks_defaults_not_trls(tmp_path) -> None:
    from trl import DPOConfig

    trl_own = DPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert trl_own.bf16 and trl_own.activation_checkpointing  # what a run would get without the overrides
    args, cfg = _dpo_config([], tmp_path)
    assert not args.bf16 and not args.activation_checkpointing
    assert (args.learning_rate, args.logging_steps) == (cfg.args.learning_rate, cfg.args.logging_steps)


def test_options_a_run_sets_pass_through(tmp_path) -> None:
    args, _ = _dpo_config(["--bf16", "true", "--gradient_checkpointing", "true", "--learning_rate", "2e-6"], tmp_path)
    assert args.bf16 and args.activation_checkpointing and args.learning_rate == 2e-6
