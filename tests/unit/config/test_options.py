"""Config loading (hftk.config.options): YAML sections and command-line overrides, every TrainingArguments field
passed through, help text on every option; and ``cfg.args``, the training options resolved once: every value
a run does not set is hftk's ``TRAINING_DEFAULTS`` or else what TrainingArguments itself would use, and no
module reads ``cfg.training`` with a default of its own (which could only disagree)."""

from __future__ import annotations

import dataclasses
import pathlib
import re

from hftk.config.options import SECTIONS, TRAINING_DEFAULTS, build_parser, load_config, training_defaults


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


def test_report_to_takes_several_reporters_as_the_readme_shows(tmp_path):
    """``--report_to wandb tensorboard`` (the README's example) and ``wandb,tensorboard`` name two reporters;
    "none" stays the Trainer's word for none (a list holding it is refused by its reporter lookup)."""
    from transformers import TrainingArguments

    base = ["--output_dir", str(tmp_path)]
    for given, want in ((["wandb", "tensorboard"], ["wandb", "tensorboard"]), (["wandb,tensorboard"], ["wandb", "tensorboard"]),
                        (["wandb"], ["wandb"]), (["none"], "none")):
        training = load_config([*base, "--report_to", *given]).training
        assert training["report_to"] == want, given
        assert TrainingArguments(output_dir=str(tmp_path), report_to=training["report_to"]).report_to == \
            (want if want != "none" else [])
    assert load_config(base).training["report_to"] == TRAINING_DEFAULTS["report_to"]


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


ROOT = pathlib.Path(__file__).resolve().parents[3]
# TrainingArguments.__post_init__ derives these from the others (None -> False, '' -> [], do_eval from
# eval_strategy, ...); hftk reads them only for truth, where both forms agree.
DERIVED = {"activation_checkpointing", "gradient_checkpointing", "include_num_input_tokens_seen", "disable_tqdm",
           "accelerator_config", "debug", "do_eval"}


def _training_fields() -> dict[str, dataclasses.Field]:
    from transformers import TrainingArguments

    return {f.name: f for f in dataclasses.fields(TrainingArguments) if f.init}


def test_unset_options_are_hftks_defaults_else_training_arguments_own():
    defaults = training_defaults()
    assert set(defaults) == set(_training_fields())
    for name, f in _training_fields().items():
        own = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        assert defaults[name] == TRAINING_DEFAULTS.get(name, own), name


def test_the_view_equals_what_training_arguments_make_of_the_same_config(tmp_path):
    from transformers import TrainingArguments

    cfg = load_config(["--output_dir", str(tmp_path), "--max_steps", "7", "--optim", "adamw_torch"])
    hf = TrainingArguments(**cfg.training)
    differ = {name for name in _training_fields()
              if getattr(getattr(hf, name), "value", getattr(hf, name)) != getattr(cfg.args, name)}
    assert differ <= DERIVED, sorted(differ - DERIVED)
    assert (cfg.args.max_steps, cfg.args.optim, cfg.args.logging_steps) == (7, "adamw_torch", 5)
    assert all(getattr(cfg.args, k) == v for k, v in TRAINING_DEFAULTS.items() if k != "output_dir")


def test_no_module_reads_a_training_option_with_a_default_of_its_own():
    """``x.get("<TrainingArguments field>", default)`` is the pattern ``cfg.args`` replaced."""
    fields = _training_fields()
    found = [f"{path.relative_to(ROOT)}:{i}: {m.group(0)}" for path in sorted((ROOT / "hftk").rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1)
             for m in re.finditer(r'\.get\("([a-z_0-9]+)",\s*[^)]+\)', line)
             if m.group(1) in fields]
    assert not found, found


def test_an_option_given_at_training_arguments_default_still_counts_as_given(tmp_path):
    """tp / cp / sp keep torch's unfused AdamW unless --optim is given: asking for adamw_torch_fused
    (TrainingArguments' own default, so left out of cfg.training) on the command line or in YAML gets it."""
    from hftk.engine.loop import training_overrides

    base = ["--strategy", "tp", "--model_name_or_path", "builtin:gpt2-tiny"]
    assert training_overrides(load_config(base)) == {"optim": "adamw_torch"}
    cli = load_config([*base, "--optim", "adamw_torch_fused"])
    assert "optim" not in cli.training and "optim" in cli.given and training_overrides(cli) == {}
    (tmp_path / "run.yaml").write_text("training:\n  optim: adamw_torch_fused\n")
    yaml = load_config([*base, "--config", str(tmp_path / "run.yaml")])
    assert training_overrides(yaml) == {}
    assert training_overrides(load_config(["--strategy", "pipeline", "--pp_size", "2"])) == {}
    assert load_config([*base, "--seed", "3"]).given == {"seed"}  # model / strategy options are not training ones
