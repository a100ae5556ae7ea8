"""Every check that can fail on user input, run before any process group exists.

Checks are ordered from cheapest (pure config) to those that read the model config or the
raw dataset, so most mistakes are reported in well under a second.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from hftk.comm.register import validate as check_compression
from hftk.config import strategy_table, support
from hftk.config.options import RunConfig
from hftk.core.errors import HftkError
from hftk.engine.resilience import check_restartable
from hftk.launch.guard import check_accelerate_launch, parent_argv
from hftk.models.lora import validate as check_lora
from hftk.models.moe import check_options as check_moe
from hftk.models.spec import model_spec


def launch_world_size() -> int:
    """World size the launcher asked for (torchrun / accelerate set WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_preference(cfg: RunConfig) -> None:
    """DPO's and GRPO's options (training.method, the preference and rl sections): values, combinations."""
    from hftk.config.options import DPO_LOSS_TYPES, GRPO_LOSS_TYPES

    p = cfg.preference
    if p.method == "grpo":
        if not 0 <= p.beta <= 100:  # a KL weight; larger values only drown the rewards
            raise HftkError("training.beta", f"must be in [0, 100] under --method grpo, got {p.beta}.",
                            "set e.g. 0.04, or 0 (TRL's default: no reference model).")
    elif not 0 < p.beta <= 100:  # exp(-beta * margin) in TRL's losses: larger values only overflow
        raise HftkError("training.beta", f"must be in (0, 100], got {p.beta}.", "set e.g. 0.1 (TRL's default).")
    own = GRPO_LOSS_TYPES if p.method == "grpo" else DPO_LOSS_TYPES
    if p.method != "sft" and p.loss_type not in own:
        raise HftkError("training.loss_type", f"'{p.loss_type}' is not a {p.method.upper()} loss.",
                        f"use one of TRL's {p.method.upper()} losses: {', '.join(own)}.")
    if p.method == "grpo":
        check_grpo(cfg)
    else:
        _refuse_grpo_options(cfg)
    if p.max_length is not None and p.max_length < 1:
        raise HftkError("training.max_length", f"must be a positive integer, got {p.max_length}.",
                        "remove it (data.block_size is used) or set e.g. 512.")
    if p.method == "dpo" and p.ref_model_name_or_path and cfg.model.lora_r > 0:
        raise HftkError("training.ref_model_name_or_path", "with LoRA the reference is the base with the adapter "
                        "disabled, so a separate reference model is never read.", "remove --ref_model_name_or_path.")


def _refuse_grpo_options(cfg: RunConfig) -> None:
    """A GRPO option on a run of another method would be ignored in silence."""
    import dataclasses

    for f in dataclasses.fields(cfg.rl):
        if getattr(cfg.rl, f.name) is not None and getattr(cfg.rl, f.name) is not False:
            raise HftkError(f"training.{f.name}", f"is set but training.method is {cfg.preference.method}: only "
                            "--method grpo reads it.", f"pass --method grpo, or drop --{f.name}.")


def check_grpo(cfg: RunConfig) -> None:
    """GRPO's options, before any process group: values, the batch its groups divide, what it cannot read."""
    r, a = cfg.rl, cfg.args
    field = "training.reward_funcs"
    if not r.reward_funcs:
        raise HftkError(field, "--method grpo needs at least one reward function.",
                        "pass --reward_funcs FILE.py:NAME (a function of completions and **kwargs returning floats).")
    if r.reward_weights is not None and len(r.reward_weights) != len(r.reward_funcs):
        raise HftkError("training.reward_weights", f"holds {len(r.reward_weights)} weights for {len(r.reward_funcs)} "
                        "reward functions.", "give one weight per --reward_funcs entry, in its order.")
    if r.reward_weights is not None and not all(abs(w) < float("inf") for w in r.reward_weights):
        raise HftkError("training.reward_weights", "holds a non-finite weight.", "use finite numbers, e.g. 1.0 0.5.")
    for name, value, accepted, what in [
            ("num_generations", r.num_generations, r.num_generations is None or r.num_generations >= 2,
             "at least 2 (the advantages compare completions of one prompt)"),
            ("max_completion_length", r.max_completion_length,
             r.max_completion_length is None or r.max_completion_length >= 1, "at least 1"),
            ("epsilon", r.epsilon, r.epsilon is None or r.epsilon > 0, "> 0 (e.g. 0.2)"),
            ("epsilon_high", r.epsilon_high, r.epsilon_high is None or r.epsilon_high > 0, "> 0 (e.g. 0.28)"),
            ("num_iterations", r.num_iterations, r.num_iterations is None or r.num_iterations >= 1, "at least 1")]:
        if not accepted:
            raise HftkError(f"training.{name}", f"must be {what}, got {value!r}.", f"set --{name} {what}, or unset.")
    world = launch_world_size()
    generations = r.num_generations or 8  # GRPOConfig's default
    batch = a.per_device_train_batch_size * a.gradient_accumulation_steps * world
    if batch % generations:
        raise HftkError("training.num_generations", f"{generations} does not divide the global batch of {batch} "
                        f"(per_device_train_batch_size {a.per_device_train_batch_size} x gradient_accumulation_steps "
                        f"{a.gradient_accumulation_steps} x {world} ranks): every prompt needs its whole group.",
                        _group_fix(generations, batch, a.per_device_train_batch_size, world,
                                   a.gradient_accumulation_steps))
    evaluates = (cfg.data.eval_fraction > 0 or cfg.data.eval_split) and cfg.training.get("eval_strategy") != "no"
    if evaluates and (a.per_device_eval_batch_size * world) % generations:
        raise HftkError("training.per_device_eval_batch_size", f"{a.per_device_eval_batch_size} x {world} ranks is "
                        f"not a multiple of num_generations {generations}: each evaluated prompt needs its group.",
                        f"use --per_device_eval_batch_size {_multiple_per_rank(generations, world)} (or a multiple), "
                        "or --eval_fraction 0.")
    if cfg.data.tokenized_path:
        raise HftkError("data.tokenized_path", "--method grpo: TRL's GRPOTrainer renders each prompt at every step, so "
                        "hftk preprocess has nothing to save for it.", "drop --tokenized_path (and hftk preprocess).")
    if cfg.data.truncation != "drop":
        raise HftkError("data.truncation", f"is {cfg.data.truncation}, but GRPO prompts are kept whole: those longer "
                        "than data.block_size are dropped.", "drop --truncation, or raise --block_size.")
    if r.use_vllm:
        import importlib.util

        if importlib.util.find_spec("vllm") is None or not torch.cuda.is_available():
            raise HftkError("training.use_vllm", "needs vLLM installed and a GPU" + (
                "" if torch.cuda.is_available() else " (this machine has none)") + ".",
                "drop --use_vllm (transformers' generate samples the rollouts), or pip install vllm on a GPU machine.")
        if cfg.strategy.strategy == "fsdp":
            raise HftkError("training.use_vllm", "is not supported with strategy fsdp: TRL syncs vLLM's weights from "
                            "FSDP1 or whole modules, not hftk's FSDP2 shards.", "use ddp or a ZeRO strategy with vLLM.")


def _group_fix(generations: int, batch: int, per_device: int, world: int, accumulation: int) -> str:
    """The nearest per-device batch sizes whose global batch holds whole groups, and the group sizes that divide
    this batch."""
    step = _multiple_per_rank(generations, world * accumulation)
    sizes = [n for n in range(step, step * 3 + 1, step)]
    divisors = [g for g in range(2, batch + 1) if batch % g == 0][:6]
    return (f"use --per_device_train_batch_size {' or '.join(map(str, sizes[:2]))} (a global batch of "
            f"{sizes[0] * world * accumulation} or {sizes[1] * world * accumulation})"
            + (f", or --num_generations {' or '.join(map(str, divisors))}" if divisors else "") + ".")


def _multiple_per_rank(generations: int, ranks: int) -> int:
    """The smallest per-rank count whose total over ``ranks`` is a multiple of ``generations``."""
    import math

    return generations // math.gcd(generations, ranks)


def _samples_field(cfg: RunConfig) -> str:
    """The option that asked for samples (what their errors name)."""
    return "samples.eval_prompts" if cfg.samples.eval_prompts else "samples.num_eval_samples"


def check_samples_options(cfg: RunConfig) -> None:
    """The samples options' combinations, and the prompt file's rows (read, not yet rendered)."""
    from hftk.publish.generate import read_prompts

    s = cfg.samples
    for name, value in (("temperature", s.temperature), ("top_p", s.top_p)):
        # GenerationConfig would only warn, and decode greedily; under GRPO they are the rollouts' (always sampled)
        if value != 1.0 and not s.do_sample and cfg.preference.method != "grpo":
            raise HftkError(f"samples.{name}", f"is {value} but greedy decoding ignores it.",
                            f"pass --do_sample to sample, or drop --{name}.")
    if s.eval_prompts and s.num_eval_samples:
        raise HftkError("samples.num_eval_samples", "is set together with samples.eval_prompts.",
                        "choose one source of sample prompts.")
    if s.num_eval_samples and cfg.data.tokenized_path:
        raise HftkError("samples.num_eval_samples", "needs the held-out rows, and data.tokenized_path holds only "
                        "their blocks.", "pass --eval_prompts FILE instead.")
    if s.eval_prompts:
        read_prompts(Path(s.eval_prompts), "samples.eval_prompts")


def check_samples(cfg: RunConfig, model_config: Any, sources: list[Any] | None = None) -> None:
    """Every sample prompt must render (messages through the run's chat template) and fit the context with
    ``sample_max_new_tokens``. ``sources``: the datasets, for ``num_eval_samples`` (None: the prompt file is
    checked)."""
    from hftk.data.dataset import heldout_prompts
    from hftk.engine.samples import prompts, requested

    if not requested(cfg):
        return
    field = _samples_field(cfg)
    if sources is None:
        if cfg.samples.eval_prompts:
            _check_prompts(cfg, model_config, prompts(cfg, [], 0), field, f"'{cfg.samples.eval_prompts}': prompt")
        return
    if not cfg.samples.num_eval_samples:
        return
    text = next((s for s in sources if s.fmt == "text"), None)
    if text is not None:
        raise HftkError(field, f"{text.cfg.dataset} is plain text: its rows have no prompt part to generate from.",
                        "pass --eval_prompts FILE with the prompts to sample.")
    held_out = heldout_prompts(sources, cfg.samples.num_eval_samples, int(cfg.args.seed))
    if not held_out:
        raise HftkError(field, "the run holds no rows out (data.eval_fraction 0 and no eval_split).",
                        "hold rows out (--eval_fraction, --eval_split), or pass --eval_prompts FILE.")
    _check_prompts(cfg, model_config, held_out, field, "held-out prompt")


def _check_prompts(cfg: RunConfig, model_config: Any, prompts: list[Any], field: str, what: str) -> None:
    from hftk.models.loading import context_length, load_tokenizer
    from hftk.publish.generate import input_ids

    tokenizer = load_tokenizer(cfg.model, cfg.data.chat_template, cfg.data.add_chat_tokens)  # the run's ids
    limit, new = context_length(model_config), cfg.samples.sample_max_new_tokens
    for number, prompt in enumerate(prompts, 1):
        try:
            length = input_ids(tokenizer, prompt, field).shape[1]
        except HftkError as exc:  # no chat template for a messages row
            raise HftkError(field, f"{what} {number}: {exc.problem}", exc.fix) from None
        except Exception as exc:  # jinja2's errors, a template's raise_exception: the first line says which
            raise HftkError(field, f"{what} {number}: the chat template cannot render it "
                            f"({str(exc).splitlines()[0][:200]}).", "fix or remove that prompt.") from None
        if limit is not None and length + new > limit:
            raise HftkError(field, f"{what} {number} has {length} tokens; with {new} new tokens "
                            f"(samples.sample_max_new_tokens) that exceeds the model's context length {limit}.",
                            "shorten it, or lower --sample_max_new_tokens.")


def check_loss(cfg: RunConfig) -> None:
    """``model.loss_implementation chunked`` only where it runs: SFT on the Trainer engine (after ``auto`` chose the
    strategy). The custom loop computes its loss on the model's logits; DPO and GRPO take TRL's own chunked
    log-probs (its ``add_fused_lm_head``)."""
    if cfg.model.loss_implementation != "chunked":
        return
    engine = strategy_table.spec(cfg.strategy.strategy).engine
    if engine != "trainer" or cfg.preference.method != "sft":
        where = f"--strategy {cfg.strategy.strategy}" if engine != "trainer" else f"--method {cfg.preference.method}"
        whose = "TRL computes its log-probs in chunks itself" if engine == "trainer" else "the custom loop computes " \
            "its loss on the model's logits"
        raise HftkError("model.loss_implementation", f"chunked runs on the Trainer engine's SFT loss (ddp, fsdp, "
                        f"ZeRO), not under {where}: {whose}.",
                        "drop --loss_implementation (auto says which loss runs) or use a Trainer strategy.")


def check_config(cfg: RunConfig) -> None:
    """Pure checks on option values and their combinations."""
    check_preference(cfg)
    check_samples_options(cfg)
    t, d, m = cfg.training, cfg.data, cfg.model
    positive = {
        "training.per_device_train_batch_size": cfg.args.per_device_train_batch_size,
        "training.per_device_eval_batch_size": cfg.args.per_device_eval_batch_size,
        "training.gradient_accumulation_steps": cfg.args.gradient_accumulation_steps,
        "data.block_size": d.block_size,
    }
    for name, value in positive.items():
        if not isinstance(value, int) or value <= 0:
            raise HftkError(name, f"must be a positive integer, got {value!r}.", f"set {name} to 1 or more.")
    if not cfg.args.learning_rate > 0:
        raise HftkError("training.learning_rate", f"must be > 0, got {cfg.args.learning_rate}.", "set e.g. 5e-4.")
    if cfg.args.max_steps <= 0 and cfg.args.num_train_epochs <= 0:
        raise HftkError("training.num_train_epochs", "must be > 0 when max_steps is not set.",
                        "set training.num_train_epochs or training.max_steps.")
    if not 0 <= d.eval_fraction < 1:
        raise HftkError("data.eval_fraction", f"must be in [0, 1), got {d.eval_fraction}.", "use e.g. 0.05.")
    if d.max_train_samples is not None and d.max_train_samples <= 0:
        raise HftkError("data.max_train_samples", "must be positive.", "remove it or set a positive count.")
    eval_cap = d.max_eval_samples
    if eval_cap is not None and (isinstance(eval_cap, bool) or not isinstance(eval_cap, int) or eval_cap <= 0):
        raise HftkError("data.max_eval_samples", f"must be a positive integer, got {d.max_eval_samples!r}.",
                        "remove it or set a positive count of evaluation blocks.")
    if cfg.tracking.comm_profile_steps < 0:
        raise HftkError("tracking.comm_profile_steps", f"must be >= 0, got {cfg.tracking.comm_profile_steps}.",
                        "use 0 (no profiling) or N to profile every N-th step.")
    if not cfg.tracking.imbalance_warn_threshold > 0:
        raise HftkError("tracking.imbalance_warn_threshold", f"must be > 0, got {cfg.tracking.imbalance_warn_threshold}.",
                        "use e.g. 0.2 (warn when the slowest rank computes 20 % longer than the fastest).")
    if m.lora_r < 0:
        raise HftkError("model.lora_r", "must be >= 0.", "use 0 (full fine-tuning) or a rank like 8.")
    if t.get("bf16") and t.get("fp16"):
        raise HftkError("training.fp16", "bf16 and fp16 are both on.", "choose one mixed-precision mode.")
    if t.get("fp16") and m.model_dtype == "float16" and not m.lora_r and not cfg.strategy.strategy.startswith("zero"):
        # The AMP loss scaler keeps fp32 master gradients only; fp16 trainable weights make it raise
        # "Attempting to unscale FP16 gradients" at the first step (LoRA adapters stay fp32 in PEFT,
        # DeepSpeed keeps its own fp32 master copy: both train).
        raise HftkError("model.model_dtype", "float16 weights with --fp16: the loss scaler cannot unscale fp16 "
                        "gradients (it needs fp32 trainable weights).",
                        "load fp32 weights (model_dtype float32) with --fp16, or use --bf16.")
    if t.get("fp16") and not torch.cuda.is_available():
        raise HftkError("training.fp16", "fp16 needs a CUDA GPU (this machine has none).",
                        "use training.bf16 on CPU, or no mixed precision.")
    if t.get("tf32"):
        from transformers.utils import is_torch_tf32_available

        if not is_torch_tf32_available():  # TrainingArguments would raise a ValueError after launch
            raise HftkError("training.tf32", "TF32 needs an NVIDIA Ampere or newer GPU (none here).",
                            "drop --tf32 (bf16 is the fast mode on CPU).")
    if t.get("hub_token"):
        raise HftkError("training.hub_token", "tokens are never taken as options (they would be saved with the run).",
                        "export HF_TOKEN or run `hf auth login`.")
    if t.get("push_to_hub") and not t.get("hub_model_id"):
        raise HftkError("training.hub_model_id", "push_to_hub needs a repository id.", "pass --hub_model_id user/name.")
    if t.get("push_to_hub"):
        from hftk.publish.hub import check_can_push

        check_can_push("training.push_to_hub")
        if t.get("hub_revision"):
            raise HftkError("training.hub_revision", "hftk pushes to the repository's main branch only.",
                            "drop --hub_revision, or push to a separate repository id.")
    if cfg.hub.hub_upload_retries < 1:
        raise HftkError("hub.hub_upload_retries", "must be at least 1.", "set it to 1 or more (default 5).")
    for name, value, accepted, what in _ranges(cfg):
        if not accepted:
            raise HftkError(name, f"must be {what}, got {value!r}.", f"set {name} {what}.")
    check_training_arguments(cfg.training)
    if d.chat_template:
        from hftk.data.chat import resolve_template

        resolve_template(d.chat_template)  # a shipped name or a readable Jinja file
    metrics = cfg.output_dir / cfg.tracking.metrics_file
    if cfg.tracking.metrics_file in ("", ".", "..") or cfg.tracking.metrics_file.endswith("/") or metrics.is_dir():
        raise HftkError("tracking.metrics_file", f"'{cfg.tracking.metrics_file}' names a folder, not a file.",
                        "use a file name like metrics.jsonl (relative to training.output_dir).")
    check_compression(cfg.strategy, launch_world_size(), dict(os.environ))
    check_restartable(dict(os.environ))
    check_accelerate_launch(dict(os.environ), parent_argv())
    _check_parallel_degrees(cfg)
    _check_output_dir(cfg)


def _ranges(cfg: RunConfig) -> list[tuple[str, Any, Any, str]]:
    """(field, value, accepted?, what is accepted) for the numeric options checked nowhere else."""
    m, d, t, a = cfg.model, cfg.data, cfg.training, cfg.args
    cores = os.cpu_count() or 1
    steps = {k: t.get(k) for k in ("logging_steps", "eval_steps", "save_steps") if t.get(k) is not None}
    return [
        ("model.model_dropout", m.model_dropout, m.model_dropout is None or 0 <= m.model_dropout < 1, "in [0, 1)"),
        ("data.preprocessing_num_workers", d.preprocessing_num_workers,
         d.preprocessing_num_workers is None or 1 <= d.preprocessing_num_workers <= cores,
         f"between 1 and this machine's {cores} cores (or unset)"),
        ("training.dataloader_num_workers", a.dataloader_num_workers,
         0 <= a.dataloader_num_workers <= cores, f"between 0 and this machine's {cores} cores"),
        ("data.pad_to_multiple_of", d.pad_to_multiple_of,
         d.pad_to_multiple_of is None or 1 <= d.pad_to_multiple_of <= d.block_size,
         f"a number of tokens between 1 and data.block_size ({d.block_size}), e.g. 8 (or unset)"),
        ("tracking.check_sync_steps", cfg.tracking.check_sync_steps, cfg.tracking.check_sync_steps >= 0, ">= 0 (0: off)"),
        ("samples.num_eval_samples", cfg.samples.num_eval_samples, cfg.samples.num_eval_samples >= 0, ">= 0 (0: off)"),
        ("samples.sample_max_new_tokens", cfg.samples.sample_max_new_tokens, cfg.samples.sample_max_new_tokens >= 1,
         "at least 1"),
        ("samples.temperature", cfg.samples.temperature, cfg.samples.temperature > 0, "> 0"),
        ("samples.top_p", cfg.samples.top_p, 0 < cfg.samples.top_p <= 1, "in (0, 1]"),
        ("hub.hub_retry_backoff_s", cfg.hub.hub_retry_backoff_s, cfg.hub.hub_retry_backoff_s >= 0, ">= 0 seconds"),
        ("training.weight_decay", a.weight_decay, a.weight_decay >= 0, ">= 0"),
        ("training.ddp_timeout", a.ddp_timeout, a.ddp_timeout > 0, "a positive number of seconds"),
        ("training.seed", a.seed, 0 <= a.seed < 2**32, "in [0, 2**32) (numpy's seed range)"),
        *[(f"training.{k}", v, v > 0, "positive (a step count, or a fraction of the run below 1)")
          for k, v in steps.items()],
    ]


def check_training_arguments(training: dict[str, Any]) -> None:
    """``TrainingArguments``' own checks, run now instead of after launch (where they were a traceback per rank).

    Its ``__post_init__`` resolves the device, which starts the process group under a launcher; a
    subclass answers the device questions with "CPU, one process" so every other check runs as
    transformers wrote it, with no group, no accelerate state and the environment left as it was."""
    from transformers import TrainingArguments
    from transformers.training_args import ParallelMode
    from transformers.utils import logging as hf_logging

    class Unlaunched(TrainingArguments):
        device = property(lambda self: torch.device("cpu"))
        n_gpu = property(lambda self: 0)
        parallel_mode = property(lambda self: ParallelMode.NOT_PARALLEL)

    env, verbosity = dict(os.environ), hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its warnings come again, once, when the engine builds the real one
    try:
        # `deepspeed` (the JSON hftk's zero strategies write) would ask the distributed state for the world size
        args = Unlaunched(**{**{k: v for k, v in training.items() if k != "deepspeed"}, "use_cpu": True})
    except (ValueError, TypeError, KeyError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        named = next((k for k in training if k in message), None) or next(
            (k for k, v in training.items() if isinstance(v, str) and f"{v} is not a valid" in message), None)
        raise HftkError(f"training.{named}" if named else "training", message.rstrip(".") + ".",
                        "see `hftk train --help` for the accepted values.") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        os.environ.clear()
        os.environ.update(env)
    from transformers.integrations import get_reporting_integration_callbacks

    try:
        get_reporting_integration_callbacks(args.report_to)
    except ValueError as exc:
        raise HftkError("training.report_to", str(exc).splitlines()[0], "pass one of those names, or none.") from None


def _check_parallel_degrees(cfg: RunConfig) -> None:
    """A tensor/sequence/context/expert-parallel degree only means something to the strategies that apply it."""
    from hftk.config.options import StrategyConfig
    from hftk.config.strategy_table import STRATEGIES

    s = cfg.strategy
    degrees = dict.fromkeys(option for spec in STRATEGIES.values() for option in spec.options)
    for name in degrees:
        owners = [n for n, spec in STRATEGIES.items() if name in spec.options]
        default = StrategyConfig.__dataclass_fields__[name].default
        if getattr(s, name) != default and s.strategy not in owners:
            raise HftkError(f"strategy.{name}", f"is {getattr(s, name)} but strategy {s.strategy} does not use it.",
                            f"pass --strategy {' or '.join(owners)}, or leave {name} at {default}.")


def _check_output_dir(cfg: RunConfig) -> None:
    """Never silently train over someone's earlier checkpoints."""
    from hftk.checkpoint.atomic import check_resumable, continues_this_job, resolve_resume

    resume = cfg.training.get("resume_from_checkpoint")
    if resume and resume != "latest" and not Path(resume).is_dir():
        raise HftkError("training.resume_from_checkpoint", f"'{resume}' is not a checkpoint folder.",
                        "pass an existing checkpoint-N folder or 'latest'.")
    if resume and resume != "latest" and not continues_this_job(cfg.output_dir):
        check_resumable(Path(resume))
    _check_writable(cfg.output_dir)
    restarted = continues_this_job(cfg.output_dir)  # an elastic round resumes its own checkpoints
    earlier = any(Path(cfg.output_dir).glob("checkpoint-*"))  # complete or not: either is someone's work
    if not resume and not restarted and earlier and not cfg.training.get("overwrite_output_dir"):
        raise HftkError("training.output_dir", f"{cfg.output_dir} already holds checkpoints of another run.",
                        "pass --resume_from_checkpoint latest to continue it, or choose a new output_dir.")
    folder = resolve_resume(cfg.output_dir, resume)
    if folder:
        check_world_change(cfg, Path(folder), launch_world_size())


def check_world_change(cfg: RunConfig, folder: Path, world_size: int) -> None:
    """A resume at another world size than ``folder`` was saved with: exact, or refused in one line.

    Strategies whose checkpoints hold whole or DCP-resharded state, or ZeRO shards that DeepSpeed converts
    to its universal checkpoint (the table's ``reshards_on_resume``: ddp, fsdp, tp, cp, sp, zero1, zero2)
    continue exactly when the global batch is kept (the Trainer then skips the same samples); every other
    format holds one piece per rank, which a resume would load in part: refused."""
    from hftk.checkpoint.atomic import saved_world
    from hftk.strategies.parallel_dims import parallel_dims

    saved, global_batch = saved_world(folder)
    if saved is None or saved == world_size:
        return
    field = "training.resume_from_checkpoint"
    module, reshards = strategy_table.get(cfg.strategy.strategy), strategy_table.spec(cfg.strategy.strategy).reshards_on_resume
    where = f"{folder} was saved by {saved} ranks; this launch has {world_size}"
    if not reshards or cfg.strategy.grad_compression != "none":
        own = getattr(module, "OTHER_WORLD_SIZE_FIX", "")
        why = "per-rank gradient compression state" if reshards else f"{cfg.strategy.strategy}'s per-rank checkpoint pieces"
        raise HftkError(field, f"{where}, and {why} cannot be split or joined across ranks.",
                        f"resume with {saved} ranks{own}.")
    args = cfg.args
    readers = parallel_dims(cfg.strategy, world_size).data_parallel
    batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * readers
    if global_batch is None:
        raise HftkError(field, f"{where}, and its seal records no global batch to continue the data position from.",
                        f"resume with {saved} ranks.")
    if batch != global_batch:
        micro = args.per_device_train_batch_size * readers
        keep = (f"--gradient_accumulation_steps {global_batch // micro} with --per_device_train_batch_size "
                f"{args.per_device_train_batch_size}" if global_batch % micro == 0 else
                f"per_device_train_batch_size x gradient_accumulation_steps x {readers} data-parallel ranks = "
                f"{global_batch}")
        raise HftkError(field, f"{where}, and the global batch would be {batch} instead of {global_batch}: "
                        "the data position would not continue where it stopped.",
                        f"keep its global batch of {global_batch}: {keep}.")


def _check_writable(output_dir: Path) -> None:
    """The output folder is a folder (or can become one) that this user may write in."""
    field = "training.output_dir"
    if output_dir.exists() and not output_dir.is_dir():
        raise HftkError(field, f"{output_dir} is a file, not a folder.", "choose a folder path for --output_dir.")
    existing = next(p for p in [output_dir, *output_dir.absolute().parents] if p.exists())
    if not existing.is_dir():
        raise HftkError(field, f"{existing} (part of {output_dir}) is a file, so the folder cannot be made.",
                        "choose a folder path for --output_dir.")
    import tempfile

    try:  # a nameless probe (O_TMPFILE): root passes permission bits, but not read-only mounts
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as exc:
        raise HftkError(field, f"cannot write in {existing}: {exc.strerror}.",
                        "choose a folder you can write to, or fix its permissions.") from None


def check_model(cfg: RunConfig, model_config: Any) -> None:
    """Checks that need the model's config (read without weights)."""
    from hftk.models.loading import context_length

    limit = context_length(model_config)
    if limit is not None and cfg.samples.sample_max_new_tokens >= limit:
        raise HftkError("samples.sample_max_new_tokens", f"{cfg.samples.sample_max_new_tokens} leaves no room for a "
                        f"prompt in the model's context length {limit}.", f"set it below {limit}, e.g. 64.")
    if limit is not None and cfg.data.block_size > limit:
        raise HftkError("data.block_size", f"{cfg.data.block_size} exceeds the model's context length {limit}.",
                        f"set data.block_size to {limit} or less.")
    if limit is not None and (cfg.preference.max_length or 0) > limit:
        raise HftkError("training.max_length", f"{cfg.preference.max_length} exceeds the model's context length "
                        f"{limit}.", f"set training.max_length to {limit} or less.")
    completion = cfg.rl.max_completion_length or 512  # GRPOConfig's default
    if cfg.preference.method == "grpo" and limit is not None and cfg.data.block_size + completion > limit:
        raise HftkError("training.max_completion_length", f"{completion} new tokens after a prompt of up to "
                        f"{cfg.data.block_size} (data.block_size) exceed the model's context length {limit}.",
                        f"set --max_completion_length {max(limit - cfg.data.block_size, 1)} or less, or lower "
                        "--block_size (the longest prompt kept).")
    check_reference(cfg, model_config)
    check_lora(cfg, model_config)
    check_moe(cfg, model_spec(model_config, cfg.model.trust_remote_code))
    hidden = getattr(model_config, "hidden_size", None)
    if cfg.model.lora_r and hidden and cfg.model.lora_r > hidden:
        raise HftkError("model.lora_r", f"{cfg.model.lora_r} exceeds the model's hidden size {hidden} (an adapter "
                        "of that rank is larger than the weights it adapts).", f"use a rank below {hidden}, e.g. 8.")
    if cfg.model.tokenizer_name_or_path:
        from hftk.models.loading import load_tokenizer

        try:
            load_tokenizer(cfg.model)
        except Exception as exc:  # transformers raises OSError, ValueError, ...: the first line says which
            raise HftkError("model.tokenizer_name_or_path", f"cannot load a tokenizer from "
                            f"'{cfg.model.tokenizer_name_or_path}': {str(exc).splitlines()[0][:300]}",
                            "pass a folder written by save_pretrained or a Hub id, or leave it unset.") from None


def check_reference(cfg: RunConfig, model_config: Any) -> None:
    """DPO's separate reference model (training.ref_model_name_or_path) must exist and score the policy's token ids:
    a vocabulary of another size would read other tokens' log-probs (or index past its embeddings)."""
    import dataclasses

    from hftk.models.loading import load_model_config

    name = cfg.preference.ref_model_name_or_path
    if cfg.preference.method != "dpo" or not name:
        return
    try:
        reference = load_model_config(dataclasses.replace(cfg.model, model_name_or_path=name))
    except HftkError as exc:
        raise HftkError("training.ref_model_name_or_path", exc.problem, exc.fix) from None
    ours, theirs = getattr(model_config, "vocab_size", None), getattr(reference, "vocab_size", None)
    if ours != theirs:
        raise HftkError("training.ref_model_name_or_path", f"'{name}' has a vocabulary of {theirs} tokens, the model "
                        f"trained ({cfg.model.model_name_or_path}) {ours}: it cannot score the same token ids.",
                        "pass a reference that shares the model's tokenizer (e.g. its base or an earlier fine-tune).")


def check_data(cfg: RunConfig, data_format: str) -> None:
    """Checks that need the datasets' formats (known once they are read); resolves ``data.packing auto``."""
    if cfg.strategy.strategy == "cp" and "messages" in data_format.split("+"):
        raise HftkError("data.data_format", "context parallel needs full blocks (ring attention takes no padding "
                        "mask) and conversations are padded, one per block.",
                        "train conversations with ddp, fsdp, zero1-3, pipeline, tp or sp.")
    resolve_packing(cfg, data_format)


def resolve_packing(cfg: RunConfig, data_format: str) -> None:
    """``data.packing`` from ``auto`` to the mode the formats, strategy and model call for (bfd only where the
    model's masks keep packed examples apart: :attr:`hftk.models.spec.ModelSpec.packing_problem`), then the
    support table's refusals (strategy, attention implementation)."""
    from hftk.models.loading import load_model_config

    d = cfg.data
    apart = model_spec(load_model_config(cfg.model), cfg.model.trust_remote_code).packing_problem
    if apart and d.packing == "bfd":
        raise HftkError("data.packing", f"bfd would pack examples into shared rows, and {apart}.",
                        "use --packing none (one example per row), or leave it auto.")
    if apart and d.packing == "auto" and data_format != "text":
        d.packing = "none"  # the model cannot keep packed examples apart: one per row
    d.packing = support.resolve_packing(cfg.strategy.strategy, data_format, d.packing, cfg.model.attn_implementation)
    if d.packing == "concat" and "messages" in data_format.split("+"):
        raise HftkError("data.packing", "concat would join conversations so that each attends to the one before it.",
                        "use --packing bfd (whole conversations kept apart) or none (one per row).")
    support.check_packing(cfg.strategy.strategy, d.packing, cfg.model.attn_implementation)
