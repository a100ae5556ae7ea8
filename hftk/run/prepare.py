"""One fine-tuning run: parse and validate everything, then hand over to an engine.

Everything up to :func:`prepare` runs before any process group exists, so bad input costs
one line on stderr and exit code 2, and nothing on disk is touched.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hftk.config import strategy_table, support
from hftk.config.options import RunConfig, is_main_process, load_config
from hftk.core import allocator, output, startup
from hftk.core.errors import HftkError, report
from hftk.core.teardown import exit_without_teardown
from hftk.data.dataset import check_holdouts, combined_format, load_sources
from hftk.data.preference import load_preference_sources
from hftk.engine.run_types import PreparedRun
from hftk.launch import configs
from hftk.models.loading import load_model_config, load_tokenizer, quantized_field, resolve_model_path
from hftk.plan import estimate
from hftk.run import validate


def prepare(argv: list[str] | None = None, read_tokenized: bool = True) -> PreparedRun:
    """Parse, validate and read what validation needs: config, model config, raw data (or the blocks of
    ``data.tokenized_path``, checked against this config); then write a built-in model into its cache
    (before any process group: see ``builtin.materialize_model``).

    A run that trains on CPU first tells glibc to give freed memory back (``allocator``): every
    engine, bench and test worker starts here, before any model exists. GPU runs keep glibc's
    defaults: their host memory is not what the plan budgets, and the setting costs CPU time. Then the
    libraries' own notices and bars are switched off (``output.quiet_libraries``) before any of them prints."""
    cfg = load_config(argv)
    on_cpu = trains_on_cpu(cfg)
    if on_cpu:
        allocator.return_freed_memory()
    output.quiet_libraries(on_cpu)  # before validation imports transformers' integrations
    configs.adopt_launcher_strategy(cfg)  # accelerate_configs/<strategy>.yaml says it through the environment
    validate.check_config(cfg)
    world_size = validate.launch_world_size()
    model_config = load_model_config(cfg.model)
    validate.check_model(cfg, model_config)
    if cfg.strategy.strategy == "auto":
        cfg.strategy.strategy = estimate.resolve_auto(cfg, model_config, world_size)
    # after auto: the strategy that runs
    support.check_method(cfg.strategy.strategy, cfg.preference.method, cfg.model.lora_r,
                         cfg.preference.precompute_ref_log_probs, quantized_field(cfg.model))
    strategy_table.get(cfg.strategy.strategy).validate(cfg, world_size)
    validate.check_loss(cfg)
    validate.check_samples(cfg, model_config)  # the prompt file's rows, with the run's tokenizer and template
    if read_tokenized and cfg.data.tokenized_path:
        from hftk.run import preprocess

        tokenized = preprocess.load(cfg, load_tokenizer(cfg.model, cfg.data.chat_template,
                                                             cfg.data.add_chat_tokens))
        return PreparedRun(cfg=cfg, model_config=model_config, raw=None, data_format=tokenized.data_format,
                           world_size=world_size, tokenized=tokenized)
    if cfg.preference.method == "grpo":  # TRL's GRPOTrainer renders the prompts at every step
        sources = grpo_sources(cfg, model_config)
        validate.check_samples(cfg, model_config, sources)  # num_eval_samples: the held-out prompts
        resolve_model_path(cfg.model)
        return PreparedRun(cfg=cfg, model_config=model_config, raw=sources[0].raw, data_format=sources[0].fmt,
                           world_size=world_size, sources=sources)
    if cfg.preference.method == "dpo":  # TRL's DPOTrainer tokenises the pairs; only the rows are checked here
        sources = load_preference_sources(cfg.data)
        validate.check_samples(cfg, model_config, sources)  # num_eval_samples: the held-out pairs' prompts
        resolve_model_path(cfg.model)
        return PreparedRun(cfg=cfg, model_config=model_config, raw=sources[0].raw, data_format=sources[0].fmt,
                           world_size=world_size, sources=sources)
    # Conversations need the tokenizer's chat template now (a built-in model is then written early).
    sources = load_sources(cfg.data, lambda: load_tokenizer(cfg.model, cfg.data.chat_template,
                                                                 cfg.data.add_chat_tokens))
    validate.check_data(cfg, combined_format(sources))
    for source in sources:  # each dataset's options were copied before check_data resolved data.packing
        source.cfg.packing = cfg.data.packing
    check_holdouts(sources)
    validate.check_samples(cfg, model_config, sources)  # num_eval_samples: the held-out rows' prompts
    resolve_model_path(cfg.model)  # valid input: a built-in is written now, before any process group
    return PreparedRun(cfg=cfg, model_config=model_config, raw=sources[0].raw, data_format=combined_format(sources),
                       world_size=world_size, sources=sources)


def grpo_sources(cfg: RunConfig, model_config: Any) -> list[Any]:
    """GRPO's prompt datasets, checked: the reward functions load and take what TRL passes, the prompts are TRL's
    formats and at most ``data.block_size`` tokens (longer ones dropped, counted), every column a reward function
    requires is in the data."""
    from hftk.data.prompts import fit_prompts, load_prompt_sources
    from hftk.engine.rewards import check_columns, load_reward_funcs

    funcs = load_reward_funcs(cfg.rl.reward_funcs or [])
    sources = load_prompt_sources(cfg.data)
    tokenizer = load_tokenizer(cfg.model, cfg.data.chat_template, cfg.data.add_chat_tokens)  # the run's rendering
    fit_prompts(sources, tokenizer, cfg.data.block_size, announce=is_main_process())
    for source in sources:
        check_columns(cfg.rl.reward_funcs, funcs, source.raw[source.cfg.train_split].column_names, source.cfg.dataset)
    return sources


def trains_on_cpu(cfg: RunConfig) -> bool:
    import torch

    return bool(cfg.training.get("use_cpu")) or not torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``scripts/finetune.py`` and ``hftk train``."""
    import importlib

    startup.mark("imports")
    try:
        prepared = prepare(argv)
    except HftkError as exc:
        return report(exc)
    startup.mark("prepare")
    output.announce_cpu(is_main_process())
    engine = strategy_table.spec(prepared.cfg.strategy.strategy).engine
    if prepared.cfg.preference.method != "sft":  # the Trainer path with TRL's trainer (support table's strategies)
        engine = {"dpo": "preference", "grpo": "rl"}[prepared.cfg.preference.method]
    resume = _resume_checkpoint(prepared.cfg.output_dir, prepared.cfg.training.get("resume_from_checkpoint"))
    resumed_step = _checkpoint_step(resume)
    if resumed_step is not None and _already_complete(prepared.cfg, resume, resumed_step):
        if is_main_process():  # the Trainer would train one step past max_steps; a rerun trains nothing
            print(_done(prepared.cfg, resumed_step), file=sys.stderr, flush=True)
        return exit_without_teardown(0) if prepared.world_size > 1 else 0
    try:
        importlib.import_module(f"hftk.engine.{engine}").train(prepared)
    except HftkError as exc:
        code = report(exc)
    except SystemExit as stop:  # an engine's deliberate stop: preemption (75), NaN policy (65)
        if prepared.world_size == 1:
            raise
        code = stop.code if isinstance(stop.code, int) else 1
    else:
        code = 0
        if is_main_process():
            print(_done(prepared.cfg, resumed_step), file=sys.stderr, flush=True)
    if prepared.world_size > 1:
        exit_without_teardown(code)  # the launcher must see this code, not a teardown abort's
    return code


def _resume_checkpoint(output_dir: Path, value: str | None) -> Path | None:
    """The checkpoint a ``--resume_from_checkpoint value`` launch resumes from (None: from scratch)."""
    from hftk.checkpoint.atomic import resolve_resume

    resume = resolve_resume(output_dir, value)
    return Path(resume) if resume else None


def _checkpoint_step(checkpoint: Path | None) -> int | None:
    from hftk.checkpoint.atomic import CHECKPOINT_RE

    match = CHECKPOINT_RE.match(checkpoint.name) if checkpoint else None
    return int(match.group(1)) if match else None


def _already_complete(cfg: RunConfig, checkpoint: Path, step: int) -> bool:
    """``checkpoint`` (possibly another run's folder) ends the run this config asks for (same step budget)
    and this run's ``final/`` holds that step."""
    import json

    from hftk.checkpoint.atomic import is_complete
    from hftk.checkpoint.run_record import RUN_FILE
    from hftk.engine.trainer import FINAL_DIR

    final = cfg.output_dir / FINAL_DIR
    if not (is_complete(final) and (checkpoint / "trainer_state.json").is_file()):
        return False
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    if cfg.args.max_steps > 0:
        target = cfg.args.max_steps
    elif cfg.args.num_train_epochs == state.get("num_train_epochs"):
        target = state["max_steps"]  # trainer_state.json always holds it
    else:
        return False
    return step >= target and json.loads((final / RUN_FILE).read_text()).get("global_step") == step


def _done(cfg: RunConfig, resumed_step: int | None) -> str:
    """The run's last line, from what ``final/``'s run record says."""
    import json

    from hftk.checkpoint.run_record import RUN_FILE
    from hftk.engine.trainer import FINAL_DIR

    final = cfg.output_dir / FINAL_DIR
    record = json.loads((final / RUN_FILE).read_text())
    metrics = record["metrics"]
    accuracy = metrics.get("eval_rewards/accuracies") if cfg.preference.method == "dpo" else None
    rewards = {k: metrics[k] for k in ("train_reward", "train_reward_step", "eval_reward") if k in metrics} \
        if cfg.preference.method == "grpo" else None
    return output.done_line(startup.elapsed(), record["global_step"], metrics.get("eval_loss"), str(final),
                            resumed_step, cfg.training.get("resume_from_checkpoint") == "latest",
                            _checkpoint_step(_resume_checkpoint(cfg.output_dir, "latest")), accuracy, rewards)


def preprocess_command(argv: list[str]) -> int:
    """``hftk preprocess [--config run.yaml] --tokenized_path DIR [options]``: the run's data, once."""
    from pathlib import Path

    from hftk.data.dataset import tokenize_sources
    from hftk.run import preprocess

    if any(a in ("-h", "--help") for a in argv):
        print("usage: hftk preprocess --config run.yaml --tokenized_path DIR [any `hftk train` option]\n\n"
              + preprocess.__doc__.strip())
        return 0
    target = load_config(argv).data.tokenized_path
    if not target:
        raise HftkError("data.tokenized_path", "hftk preprocess needs a folder to write.", "pass --tokenized_path DIR.")
    if Path(target).exists():
        raise HftkError("data.tokenized_path", f"'{target}' already exists.", "choose a new folder or delete it.")
    prepared = prepare(argv, read_tokenized=False)
    cfg = prepared.cfg
    tokenizer = load_tokenizer(cfg.model, cfg.data.chat_template, cfg.data.add_chat_tokens, announce=True)
    if cfg.preference.method == "dpo":
        data = _tokenized_pairs(prepared, tokenizer)
    else:
        data = tokenize_sources(prepared.sources, tokenizer, cfg.training["seed"])
    summary = preprocess.save(Path(target), data, preprocess.fingerprint(cfg, tokenizer))
    parts = [f"{name}: {s['pairs']} pairs, {s['tokens']} tokens" if "pairs" in s else
             f"{name}: {s['blocks']} blocks, {s['tokens']} tokens ({s['labelled_tokens']} labelled)"
             for name, s in summary.items()]
    print(f"hftk: preprocess: {data.data_format}; " + "; ".join(parts) + f" -> {target}", flush=True)
    return 0


def _tokenized_pairs(prepared: PreparedRun, tokenizer: Any) -> Any:
    """The run's preference pairs as its DPOTrainer would tokenise them (TRL's own code, TRL's defaults for
    what hftk does not set), held to ``max_length`` as ``data.truncation`` says."""
    from trl import DPOConfig

    from hftk.data.dataset import TokenizedData, split_and_mix
    from hftk.data.preference import fit_pairs, tokenize_pairs
    from hftk.engine.preference import dpo_options

    cfg = prepared.cfg
    args = DPOConfig(output_dir=cfg.data.tokenized_path, max_length=dpo_options(cfg)["max_length"],
                     dataset_num_proc=cfg.data.preprocessing_num_workers, report_to="none", use_cpu=True)
    splits = dict(zip(("train", "eval"), split_and_mix(prepared.sources, cfg.training["seed"])))
    pairs = {name: fit_pairs(tokenize_pairs(rows, tokenizer, args, name), len(rows), args.max_length,
                             cfg.data.truncation, name, announce=True)
             for name, rows in splits.items() if rows is not None}
    return TokenizedData(train=pairs["train"], eval=pairs.get("eval"), data_format=prepared.data_format)
