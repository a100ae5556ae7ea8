"""The HF Trainer engine: build TrainingArguments, data, model, callbacks; train; save.

Order matters: ``TrainingArguments`` is built first because it starts the process group
and, for ZeRO-3, registers the DeepSpeed config that ``from_pretrained`` must see.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from hftk.checkpoint.atomic import announce_resume, install_atomic_checkpoints, resolve_resume, staged_folder
from hftk.checkpoint.run_record import run_record, save_run_record, write_run_files
from hftk.comm.callback import CompressionCallback
from hftk.comm.register import is_active as comm_active
from hftk.config import strategy_table
from hftk.config.options import is_main_process
from hftk.core import startup
from hftk.core.agent_store import node_first
from hftk.core.errors import HftkError
from hftk.data.dataset import announce_eval, collator, tokenize_sources
from hftk.engine import samples
from hftk.engine.resilience import StepGuard, guarded, step_guard
from hftk.engine.run_types import PreparedRun
from hftk.launch.guard import WorldGuard, check_world
from hftk.models import lora, moe
from hftk.models import loss as causal_loss
from hftk.models.loading import fit_to_tokenizer, load_model, load_tokenizer
from hftk.publish.hub import run_pusher
from hftk.telemetry.memory import ModelStateCallback
from hftk.telemetry.metrics import MetricsCallback, SyncCheckCallback, logged_eval
from hftk.telemetry.rank_monitor import (RankMonitor, RankMonitorCallback, compute_dtype, device_peak_flops,
                                         flops_per_token)

FINAL_DIR = "final"


def build_training_arguments(prepared: PreparedRun, extra: dict[str, Any], arguments_class: Any = None) -> Any:
    """``TrainingArguments`` (or a subclass: TRL's ``DPOConfig``) from the validated config; starts the
    process group."""
    from transformers import TrainingArguments

    cfg = prepared.cfg
    kwargs = {**cfg.training, **extra}
    kwargs.setdefault("use_cpu", not torch.cuda.is_available())
    kwargs.setdefault(_checkpointing_kwargs_field(), {"use_reentrant": False})  # reentrant breaks DDP + LoRA
    if prepared.data_format == "text" and cfg.data.packing == "concat":
        # Packed text: every block's labels are all real tokens, so every rank counts the same number
        # and the Trainer's per-step all-reduce of token counts (a sync point) changes nothing.
        kwargs.setdefault("average_tokens_across_devices", False)
    if cfg.data.packing == "bfd":
        # The collator needs each row's seq_lengths, a column the model's forward signature does not name.
        kwargs["remove_unused_columns"] = False
    if not prepared.has_eval:
        kwargs["eval_strategy"] = "no"
    kwargs["push_to_hub"] = False  # hftk.publish.hub pushes (card, retries, background); the Trainer would push twice
    configure_wandb(cfg, kwargs.get("report_to"))
    if kwargs["use_cpu"] and not kwargs.get("deepspeed"):  # DeepSpeed starts its own (strategies/deepspeed.py)
        _start_cpu_state(kwargs.get("ddp_backend"), int(cfg.args.ddp_timeout))
    return (arguments_class or TrainingArguments)(**kwargs)


def _start_cpu_state(backend: str | None, timeout_s: int) -> None:
    """Start accelerate's shared state (the process group) with ``ddp_timeout``: transformers 5.24 hands
    the timeout to accelerate only on accelerators, so a CPU group got gloo's 30 minutes whatever the
    option said. ``TrainingArguments`` then finds the state started and reuses it as it is."""
    from datetime import timedelta

    from accelerate import PartialState

    PartialState(cpu=True, backend=backend, timeout=timedelta(seconds=timeout_s))


def _checkpointing_kwargs_field() -> str:
    """transformers renamed gradient_checkpointing_kwargs (5.x keeps the old name as an alias)."""
    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing_kwargs" if "activation_checkpointing_kwargs" in names else "gradient_checkpointing_kwargs"


def configure_wandb(cfg: Any, report_to: str | list[str] | None) -> None:
    """wandb runs offline (files under the output dir) unless an API key is configured."""
    report_to = report_to or []
    if "wandb" not in (report_to if isinstance(report_to, list) else [report_to]):
        return
    os.environ.setdefault("WANDB_PROJECT", cfg.tracking.wandb_project)
    os.environ.setdefault("WANDB_DIR", str(cfg.output_dir))
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    has_key = os.environ.get("WANDB_API_KEY") or "api.wandb.ai" in _netrc_text()
    if not has_key:
        os.environ["WANDB_MODE"] = "offline"


def _netrc_text() -> str:
    path = Path.home() / ".netrc"
    return path.read_text() if path.exists() else ""


def run_callbacks(prepared: PreparedRun, trainer: Any, strategy: Any) -> list[Any]:
    """Every hftk callback of a Trainer run, in order (each feature adds its own here)."""
    cfg, args = prepared.cfg, trainer.args
    samples_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    tokens_per_step = samples_per_step * cfg.data.block_size
    peak = device_peak_flops(args.device, compute_dtype(args.bf16, args.fp16))
    metrics_cb = MetricsCallback(cfg.output_dir / cfg.tracking.metrics_file, tokens_per_step=tokens_per_step,
                                 samples_per_step=samples_per_step,
                                 flops_per_step=tokens_per_step * flops_per_token(
                                     trainer.model, cfg.data.block_size, moe.active_shares(trainer.model)),
                                 peak_flops=peak * args.world_size if peak else None,
                                 perplexity=cfg.preference.method == "sft")
    # First in line so tensorboard / wandb see the throughput and perplexity it adds to each log.
    trainer.callback_handler.callbacks.insert(0, metrics_cb)
    # Ahead of it: per-rank memory, comm share and imbalance join the same log line.
    monitor = RankMonitor(args.device, cfg.tracking.imbalance_warn_threshold, cfg.tracking.comm_profile_steps)
    trainer.callback_handler.callbacks.insert(0, RankMonitorCallback(monitor, metrics_cb.metrics_path))
    if comm_active(cfg.strategy):
        # Ahead of the metrics callback, so the byte counters it adds to each log reach metrics.jsonl.
        resume = resolve_resume(cfg.output_dir, cfg.training.get("resume_from_checkpoint"))
        trainer.callback_handler.callbacks.insert(0, CompressionCallback(trainer, cfg.strategy, resume))
    callbacks: list[Any] = [WorldGuard(strategy.verify, trainer), StepGuard(trainer, cfg.resilience.nan_policy),
                            ModelStateCallback(metrics_cb.metrics_path)]
    if hasattr(strategy, "callbacks"):  # after WorldGuard: a strategy's own callbacks see a verified engine
        callbacks[1:1] = strategy.callbacks(trainer)
    if cfg.tracking.check_sync_steps > 0:
        callbacks.append(SyncCheckCallback(cfg.tracking.check_sync_steps, metrics_cb.metrics_path))
    if lora.is_peft(trainer.model):
        callbacks.append(lora.QuantizationRecordCallback(trainer.model))
    return callbacks


def add_samples(prepared: PreparedRun, trainer: Any) -> None:
    """Generation samples when the run asks for them (the samples options), first in line: at train end they are
    generated before tensorboard closes its writer."""
    cfg = prepared.cfg
    if samples.requested(cfg):
        trainer.callback_handler.callbacks.insert(0, samples.SamplesCallback(
            trainer, cfg, samples.prompts(cfg, prepared.sources, trainer.args.seed)))


def load_data(prepared: PreparedRun, seed: int) -> tuple[Any, Any]:
    """Tokenizer and tokenised blocks, shared by every engine: each node's rank 0 tokenises first, the
    others wait on the launcher's store (no collective: a long tokenisation never meets ``ddp_timeout``),
    then read its datasets cache."""
    cfg = prepared.cfg
    tokenizer = load_tokenizer(cfg.model, cfg.data.chat_template, cfg.data.add_chat_tokens,  # saved with it:
                               announce=is_main_process())  # checkpoints and final/
    if prepared.tokenized is not None:  # hftk preprocess made the blocks; every rank read them in prepare
        return tokenizer, prepared.tokenized
    with node_first("tokenize"):
        data = tokenize_sources(prepared.sources, tokenizer, seed)
    if prepared.has_eval and data.eval is None:
        raise HftkError("data.eval_fraction", f"the held-out text is shorter than one block of {cfg.data.block_size}.",
                        "raise data.eval_fraction, lower data.block_size, or set data.eval_fraction to 0.")
    return tokenizer, data


def build_trainer(prepared: PreparedRun) -> tuple[Any, Any, Any]:
    """Everything up to a ready Trainer: (trainer, strategy module, tokenised data).

    ``hftk bench`` builds several Trainers in one process group with it (no final save, no teardown).
    """
    from transformers import Trainer

    cfg = prepared.cfg
    strategy = strategy_table.get(cfg.strategy.strategy)
    args = build_training_arguments(prepared, strategy.training_arguments(cfg, prepared.model_config))
    check_world(args.world_size)
    startup.mark("process_group")

    tokenizer, data = load_data(prepared, args.seed)
    announce_eval(cfg.data, data.eval, args.per_device_eval_batch_size, args.world_size, args.process_index == 0)
    startup.mark("data")
    base = load_model(cfg.model, shardable=getattr(strategy, "SHARDS_PARAMETERS", False))
    new_tokens = fit_to_tokenizer(base, tokenizer, args.seed)  # chat markers added: before LoRA and sharding
    base = lora.apply(base, cfg, args, new_tokens)
    install_loss(base, cfg, args.process_index == 0)  # after LoRA (an adapter on the head counts), before sharding
    # The Trainer sums the micro-batches of an accumulation window (their losses are normalised by the window's
    # tokens) and, when it averages tokens across devices, multiplies each rank's loss by the world size (its
    # gradients are averaged): the balancing loss's weight is divided by what it would be summed over.
    summed_over = args.gradient_accumulation_steps * (args.world_size if args.average_tokens_across_devices else 1)
    routed = moe.prepare(base, cfg, summed_over, args.device)
    router = moe.RouterStats(base) if routed else None  # its hooks on the blocks, before they are sharded
    model = strategy.prepare_model(base, cfg)  # LoRA before any sharding
    startup.mark("model")

    # A strategy that owns its model/optimizer I/O (FSDP2 shards) supplies its own Trainer.
    make_trainer = strategy.trainer_factory(cfg) if hasattr(strategy, "trainer_factory") else Trainer
    trainer = make_trainer(
        model=model, args=args, train_dataset=data.train, eval_dataset=data.eval,
        data_collator=collator(cfg.data, tokenizer.pad_token_id, attention=cfg.model.attn_implementation),
        processing_class=tokenizer,
    )
    count_flops_once(trainer)
    for callback in run_callbacks(prepared, trainer, strategy):
        trainer.add_callback(callback)
    if router is not None:  # first in line: its metrics join the log the metrics callback writes
        trainer.callback_handler.callbacks.insert(0, moe.RouterCallback(router))
    add_samples(prepared, trainer)
    startup.mark("trainer")
    return trainer, strategy, data


def install_loss(model: Any, cfg: Any, main: bool) -> None:
    """The run's causal-LM loss (``model.loss_implementation``), said once at start."""
    implementation = causal_loss.choose(cfg.model.loss_implementation, "trainer")
    if implementation == "chunked":
        causal_loss.install(model)
    if main:
        print(causal_loss.announce(implementation, causal_loss.vocab_size(model), "trainer"), flush=True)


def count_flops_once(trainer: Any) -> None:
    """``Trainer.floating_point_ops`` with the parameter count taken once instead of at every micro-batch.

    The Trainer recounts the model's parameters for its ``total_flos`` estimate on every step (about 3 ms
    per step on the default model, the largest of the Trainer path's own per-step costs); the count
    cannot change while training, so the same formula runs on the count taken here."""
    model = trainer.model
    if not hasattr(model, "num_parameters"):
        return
    main_input = getattr(model, "main_input_name", "input_ids")
    per_token = 6 * model.num_parameters(exclude_embeddings=True)
    trainer.floating_point_ops = lambda inputs: per_token * inputs[main_input].numel() if main_input in inputs else 0


def train(prepared: PreparedRun, build: Any = None, summary: Any = None) -> dict[str, float]:
    """Run the Trainer (``build``: another Trainer's builder, e.g. DPO's) for a prepared (validated) config,
    save ``final``, then tear the process group down; returns the final metrics (with ``summary(trainer)``'s: what
    a method adds to the run record, e.g. GRPO's final mean reward)."""
    cfg = prepared.cfg
    trainer, strategy, data = (build or build_trainer)(prepared)
    pusher = run_pusher(prepared, trainer, cfg.output_dir / cfg.tracking.metrics_file)
    install_atomic_checkpoints(trainer, after_publish=pusher.checkpoint_published if pusher else None)
    resume = resolve_resume(cfg.output_dir, cfg.training.get("resume_from_checkpoint"))
    announce_resume(cfg.output_dir, resume, trainer.args.should_save, prepared.world_size)
    if trainer.args.should_save:  # what `hftk push checkpoint-N` writes the model card from
        save_run_record(cfg.output_dir, run_record(cfg, trainer.args, prepared.world_size, prepared.data_format, 0))
    # Preempted, or nan_policy=stop: `guarded` saves (if the Trainer did not) and exits with its own code.
    with step_guard(trainer).signal.watching():  # through the final evaluation: a signal there interrupts it
        # a strategy may resume from a converted form of the checkpoint (DeepSpeed's universal one)
        load_from = strategy.resume_folder(resume) if hasattr(strategy, "resume_folder") else resume
        metrics = dict(guarded(trainer, lambda: trainer.train(resume_from_checkpoint=load_from)).metrics)
        step = trainer.state.global_step
        if data.eval is not None:  # the final weights' evaluation: logged at the last step, else run now
            metrics.update(logged_eval(trainer.state.log_history, step) or guarded(trainer, trainer.evaluate))
        metrics.update(summary(trainer) if summary is not None else {})
    with staged_folder(cfg.output_dir / FINAL_DIR, publisher=trainer.args.should_save) as final:
        if lora.is_peft(trainer.model):
            lora.save_final(trainer, final)  # the adapter, gathered from whatever shards it
        else:
            strategy.save_final(trainer, final)
        if trainer.args.should_save:
            record = run_record(cfg, trainer.args, prepared.world_size, prepared.data_format, step, metrics)
            write_run_files(final, record, cfg.training.get("hub_model_id"))
    if pusher is not None:
        pusher.push_final(cfg.output_dir / FINAL_DIR, step)  # waits; a failed push is reported, not raised
    # Torn down by us: gloo aborts ("terminate called without an active exception") when the
    # interpreter exits with the group still alive.
    trainer.accelerator.end_training()
    return metrics
