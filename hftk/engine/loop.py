"""The one custom training loop: for what the HF Trainer cannot drive (pipeline stages; tp / cp / sp / ep meshes).

A strategy whose table ``engine`` is ``loop`` supplies its *step* (``build_step(model, cfg, args)``):
how one optimizer step's batches go forward and backward and their gradients are reduced, the
clipping domain, evaluation sums, its sharded state and the final folder. Everything else is
here, once, and is the Trainer's own machinery or hftk's shared code, so a custom-loop run and a
Trainer run of the same config take the same steps:

- ``TrainingArguments`` from :func:`hftk.engine.trainer.build_training_arguments` (it also
  starts the process group: gloo on CPU, NCCL on GPU);
- data from :mod:`hftk.data.dataset`, sampled like the Trainer (accelerate's seedable sampler, one
  shard per data-parallel replica, ``skip_first_batches`` on resume);
- the optimizer class and kwargs from the Trainer's ``get_optimizer_cls_and_kwargs`` over the
  step's decay / no-decay groups; the schedule from ``get_scheduler``;
- flow control (when to log, evaluate, save, stop) from the Trainer's ``TrainerState``,
  ``TrainerControl`` and ``DefaultFlowCallback``; metrics through the same callbacks as a Trainer
  run (hftk's ``MetricsCallback`` writing ``metrics.jsonl``, the rank monitor, tensorboard / wandb);
- hftk.engine.resilience's stop rules (non-finite gradients, preemption) agreed in one all-reduce;
- ``checkpoint-N`` through :class:`hftk.checkpoint.checkpointer.Checkpointer` (``latest`` resumes), the final
  folder through the step (or the LoRA adapter), pushed by :class:`hftk.publish.hub.RunPusher`.

The step protocol: attributes ``device``, ``dp_size``, ``dp_rank``, ``params`` (named parameters
of this rank), ``module`` (what the rank holds, for memory counts), ``monitored`` (a model the
rank monitor may hook, or None), ``config``, ``describe`` (logged once), ``replica_key`` (ranks
whose weights must be equal share one); methods ``param_groups(weight_decay)``,
``forward_backward(batches) -> global mean loss``, ``clip_gradients(max_norm) -> norm``,
``eval_sums(batch) -> [loss sum, count]`` summed over the world, ``save(folder, optimizer)``,
``load(folder, optimizer)``, ``save_final(folder, tokenizer)`` (into the final save's staged folder); optionally
``callbacks`` (Trainer callbacks of its own, ahead of the metrics callback: expert parallel's all-to-all counters).
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hftk.checkpoint.atomic import announce_resume, load_rng, resolve_resume, staged_folder
from hftk.checkpoint.checkpointer import Checkpointer, TrainerStateFile
from hftk.checkpoint.run_record import run_record, save_run_record, write_run_files
from hftk.comm.collectives import gather_objects
from hftk.config import strategy_table
from hftk.core import startup
from hftk.data.dataset import announce_eval, collator
from hftk.engine import samples
from hftk.engine.resilience import (EXIT_PREEMPTED, EvaluationInterrupted, PreemptionSignal, check_evaluation,
                                    decide_step, nonfinite_gradients, stop_line)
from hftk.engine.run_types import PreparedRun
from hftk.engine.trainer import FINAL_DIR, build_training_arguments, load_data
from hftk.launch.guard import check_world
from hftk.models import lora, moe
from hftk.models.loading import fit_to_tokenizer, load_model
from hftk.publish.hub import RunPusher
from hftk.telemetry.memory import model_state_bytes
from hftk.telemetry.metrics import MetricsCallback, SyncCheckCallback, append_jsonl, logged_eval
from hftk.telemetry.rank_monitor import (RankMonitor, RankMonitorCallback, compute_dtype, device_peak_flops,
                                         flops_per_token, peak_memory_bytes)
from hftk.telemetry.samples import report_samples


@dataclass
class Run:
    """Everything one loop run holds (no behaviour: the functions below act on it)."""

    prepared: PreparedRun
    args: Any
    step: Any  # the strategy's step (see the module docstring)
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_loader: Any
    eval_set: Any | None
    collate: Any
    state: Any  # transformers.TrainerState
    control: Any  # transformers.TrainerControl
    handler: Any  # transformers CallbackHandler
    monitor: RankMonitor
    checkpointer: Checkpointer
    metrics_path: Path
    pusher: RunPusher | None = None
    last_logged: int = 0
    window_loss: float = 0.0  # summed step losses since the last log
    total_loss: float = 0.0  # summed step losses of this run (-> train_loss)
    signal: PreemptionSignal = field(default_factory=PreemptionSignal)
    exit_code: int | None = None  # set when preempted or nan_policy=stop: save, then exit with it
    stop_reason: str = ""
    nonfinite_steps: list[int] = field(default_factory=list)
    adapter: tuple[Any, dict[str, tuple[int, ...]]] | None = None  # LoRA: (PEFT config, each adapter weight's shape)
    state_bytes: dict[str, int] | None = None  # this rank's model state, counted at its first optimizer step
    lifetime_peak: int = 0  # imports, loading and sharding
    prompts: list[Any] = field(default_factory=list)  # generation samples' prompts (the samples options)
    sampled: set[int] = field(default_factory=set)  # steps already sampled

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def global_batch(self) -> int:
        return self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps * self.step.dp_size




def init_process_group(args: Any) -> None:
    """The process group when TrainingArguments did not start one (a single process: accelerate starts
    none, while a device mesh needs one): the launcher's rendezvous, else a local store."""
    if dist.is_initialized():
        return
    timeout = timedelta(seconds=int(args.ddp_timeout))
    if args.device.type == "cuda":
        torch.cuda.set_device(args.device)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(timeout=timeout)
    else:
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def training_overrides(cfg: Any) -> dict[str, Any]:
    """The strategy's own defaults for options the user did not give (tp / cp / sp: torch's unfused AdamW)."""
    defaults = getattr(strategy_table.get(cfg.strategy.strategy), "LOOP_DEFAULTS", {})
    return {key: value for key, value in defaults.items() if key not in cfg.given}


def train(prepared: PreparedRun) -> dict[str, float]:
    """Entry point for strategies whose table ``engine`` is this module: train one prepared config, then
    tear the process group down."""
    from transformers import set_seed

    cfg = prepared.cfg
    strategy = strategy_table.get(cfg.strategy.strategy)
    args = build_training_arguments(prepared, training_overrides(cfg))
    init_process_group(args)
    check_world(dist.get_world_size())
    startup.mark("process_group")
    set_seed(args.seed)
    tokenizer, data = load_data(prepared, args.seed)
    startup.mark("data")
    model = load_model(cfg.model)
    model = lora.apply(model, cfg, args, fit_to_tokenizer(model, tokenizer, args.seed))
    _enable_activation_checkpointing(model, args)
    routed = moe.prepare(model, cfg, _micro_batches_per_step(cfg, args), args.device)
    token_flops = flops_per_token(model, cfg.data.block_size, moe.active_shares(model))
    adapter = (model.peft_config[lora.ADAPTER_NAME], lora.adapter_shapes(model)) if lora.is_peft(model) else None
    step = strategy.build_step(model, cfg, args)
    router = moe.RouterStats(model) if routed else None  # on the blocks this rank holds
    del model  # this rank keeps only its shards or stages
    startup.mark("model")
    announce_eval(cfg.data, data.eval, args.per_device_eval_batch_size, step.dp_size, dist.get_rank() == 0)

    optimizer = _make_optimizer(args, step)
    collate = collator(cfg.data, tokenizer.pad_token_id, fixed_length=cfg.data.block_size)  # fixed shapes
    train_loader = _train_loader(args, data.train, step, collate)
    max_steps, steps_per_epoch, epochs = _plan_steps(args, len(train_loader))
    scheduler = _make_scheduler(args, optimizer, max_steps)
    run = _start_run(prepared, args, step, tokenizer, optimizer, scheduler, train_loader, data.eval, collate,
                     max_steps, epochs, token_flops, adapter)
    if router is not None:  # first in line: its metrics join the log the metrics callback writes
        run.handler.callbacks.insert(0, moe.RouterCallback(router))
    run.prompts = samples.prompts(cfg, prepared.sources, args.seed)
    startup.mark("trainer")
    metrics = _train_epochs(run, steps_per_epoch, epochs)
    # Torn down by us: gloo aborts when the interpreter exits with the group still alive.
    dist.barrier()
    dist.destroy_process_group()
    return metrics


# ---------------------------------------------------------------------------------------------
# Construction (the Trainer's choices, reused)
# ---------------------------------------------------------------------------------------------

def _micro_batches_per_step(cfg: Any, args: Any) -> int:
    """Forwards whose balancing losses one optimizer step averages (hftk.models.moe): every data-parallel rank's
    accumulation windows, each cut into the pipeline's micro-batches."""
    from hftk.strategies.parallel_dims import parallel_dims

    dims = parallel_dims(cfg.strategy, dist.get_world_size())
    pipeline = cfg.strategy.pp_microbatches if cfg.strategy.strategy == "pipeline" else 1
    return dims.data_parallel * args.gradient_accumulation_steps * pipeline


def _enable_activation_checkpointing(model: Any, args: Any) -> None:
    """As ``Trainer.train`` does; the blocks then checkpoint themselves inside each stage or shard."""
    if not (args.activation_checkpointing or args.gradient_checkpointing):
        return
    kwargs = dict(args.activation_checkpointing_kwargs or {})
    every_n_layers = kwargs.pop("every_n_layers", 1)
    offload = kwargs.pop("offload", False)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None,
                                          every_n_layers=every_n_layers, offload=offload)


def _make_optimizer(args: Any, step: Any) -> torch.optim.Optimizer:
    from transformers import Trainer

    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    return cls(step.param_groups(args.weight_decay), **kwargs)


def _make_scheduler(args: Any, optimizer: torch.optim.Optimizer, max_steps: int) -> Any:
    from transformers import get_scheduler

    return get_scheduler(args.lr_scheduler_type, optimizer=optimizer,
                         num_warmup_steps=args.get_warmup_steps(max_steps), num_training_steps=max_steps,
                         scheduler_specific_kwargs=args.lr_scheduler_kwargs)


def _train_loader(args: Any, dataset: Any, step: Any, collate: Any) -> Any:
    """The Trainer's train loader, sharded over data-parallel replicas instead of all ranks."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader, RandomSampler

    loader = DataLoader(dataset, batch_size=args.per_device_train_batch_size, sampler=RandomSampler(dataset),
                        collate_fn=collate, drop_last=args.dataloader_drop_last,
                        num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory)
    acc = args.accelerator_config
    return prepare_data_loader(loader, device=None, num_processes=step.dp_size, process_index=step.dp_rank,
                               split_batches=acc.split_batches, put_on_device=False, rng_types=None,
                               even_batches=acc.even_batches, use_seedable_sampler=acc.use_seedable_sampler,
                               data_seed=args.data_seed)


def _eval_batches(run: Run) -> Any:
    """This replica's rows of each evaluation chunk (``batch x replicas`` samples), collated.

    Every rank runs the same number of forwards (sharded layouts need all ranks in each
    collective): a replica with no samples left in the last chunk reads one with its labels
    ignored. A preemption signal on any rank stops it before the next batch
    (:class:`hftk.engine.resilience.EvaluationInterrupted`).
    """
    size, dp, rank = run.args.per_device_eval_batch_size, run.step.dp_size, run.step.dp_rank
    n = len(run.eval_set)
    for start in range(0, n, size * dp):
        check_evaluation(run.signal, run.step.device)
        chunk = range(start, min(start + size * dp, n))
        mine = list(chunk[rank * size:(rank + 1) * size])
        rows = run.collate([run.eval_set[i] for i in mine or chunk[:1]])
        if not mine:
            rows["labels"].fill_(-100)
        yield rows


def _plan_steps(args: Any, batches_per_epoch: int) -> tuple[int, int, int]:
    """(max_steps, optimizer steps per epoch, epochs) exactly as ``Trainer.set_initial_training_values``."""
    accum = args.gradient_accumulation_steps
    per_epoch = max(batches_per_epoch // accum + int(batches_per_epoch % accum > 0), 1)
    if args.max_steps > 0:
        return args.max_steps, per_epoch, args.max_steps // per_epoch + int(args.max_steps % per_epoch > 0)
    return math.ceil(args.num_train_epochs * per_epoch), per_epoch, math.ceil(args.num_train_epochs)


def _start_run(prepared: PreparedRun, args: Any, step: Any, tokenizer: Any, optimizer: Any, scheduler: Any,
               train_loader: Any, eval_set: Any, collate: Any, max_steps: int, epochs: int, token_flops: float,
               adapter: Any) -> Run:
    from transformers import DefaultFlowCallback, TrainerControl, TrainerState
    from transformers.integrations import get_reporting_integration_callbacks
    from transformers.trainer_callback import CallbackHandler

    cfg = prepared.cfg
    state = TrainerState()
    state.train_batch_size = args.per_device_train_batch_size
    state.compute_steps(args, max_steps)
    state.max_steps, state.num_train_epochs = max_steps, epochs
    state.is_world_process_zero = dist.get_rank() == 0
    state.is_local_process_zero = args.local_process_index == 0
    samples_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * step.dp_size
    metrics_path = cfg.output_dir / cfg.tracking.metrics_file
    tokens_per_step = samples_per_step * cfg.data.block_size
    peak = device_peak_flops(step.device, compute_dtype(args.bf16, args.fp16))
    metrics_cb = MetricsCallback(metrics_path, tokens_per_step=tokens_per_step, samples_per_step=samples_per_step,
                                 flops_per_step=tokens_per_step * token_flops,
                                 peak_flops=peak * dist.get_world_size() if peak else None)
    lifetime_peak = peak_memory_bytes(step.device)  # imports, loading, sharding (the monitor resets the peak)
    monitor = RankMonitor(step.device, cfg.tracking.imbalance_warn_threshold, cfg.tracking.comm_profile_steps)
    callbacks = [*getattr(step, "callbacks", ()), RankMonitorCallback(monitor, metrics_path), metrics_cb,
                 DefaultFlowCallback, *get_reporting_integration_callbacks(args.report_to)]
    if cfg.tracking.check_sync_steps > 0:  # tp / cp / sp / ep refuse it before launch: their shards have no replicas
        callbacks.append(SyncCheckCallback(cfg.tracking.check_sync_steps, metrics_path, step.replica_key,
                                           step.module))
    handler = CallbackHandler(callbacks, step.monitored, tokenizer, optimizer, scheduler)
    checkpointer = Checkpointer(cfg.output_dir, step, optimizer,
                                {"scheduler.pt": scheduler, "trainer_state.json": TrainerStateFile(state)},
                                args.save_total_limit, samples_per_step, step.config, tokenizer,
                                extra=partial(_write_adapter, step, adapter))
    run = Run(prepared=prepared, args=args, step=step, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler,
              train_loader=train_loader, eval_set=eval_set, collate=collate, state=state, control=TrainerControl(),
              handler=handler, monitor=monitor, checkpointer=checkpointer, metrics_path=metrics_path, adapter=adapter,
              lifetime_peak=lifetime_peak)
    if cfg.training.get("push_to_hub") and dist.get_rank() == 0:
        run.pusher = RunPusher(cfg, args, dist.get_world_size(), prepared.data_format, metrics_path, step.dp_size)
    return run


# ---------------------------------------------------------------------------------------------
# The loop (the shape of Trainer._inner_training_loop / _run_epoch)
# ---------------------------------------------------------------------------------------------

def _train_epochs(run: Run, steps_per_epoch: int, epochs: int) -> dict[str, float]:
    args, state, cfg = run.args, run.state, run.prepared.cfg
    accum = args.gradient_accumulation_steps
    resume = resolve_resume(cfg.output_dir, cfg.training.get("resume_from_checkpoint"))
    epochs_trained, skip_batches = 0, 0
    announce_resume(cfg.output_dir, resume, run.rank == 0, world_size=dist.get_world_size())
    if run.rank == 0:  # what `hftk push checkpoint-N` writes the model card from
        save_run_record(cfg.output_dir, _run_record(run, 0, None))
    if resume:
        run.checkpointer.load(Path(resume))
        epochs_trained = state.global_step // steps_per_epoch
        skip_batches = (state.global_step % steps_per_epoch) * accum
    _log_layout(run)
    run.last_logged = state.global_step
    start, start_step = time.time(), state.global_step
    run.control = run.handler.on_train_begin(args, state, run.control)
    _describe_to_wandb(run)
    with run.signal.watching():  # through the final evaluation: a signal there interrupts it
        _run_epochs(run, resume, steps_per_epoch, epochs, epochs_trained, skip_batches)
        _log_memory(run)
        metrics = _finish(run, start, start_step) if run.exit_code is None else {}
    if run.exit_code is not None:
        _stop(run)
    _save_final(run, metrics)
    return metrics


def _run_epochs(run: Run, resume: str | None, steps_per_epoch: int, epochs: int, epochs_trained: int,
                skip_batches: int) -> None:
    args, state = run.args, run.state
    accum = args.gradient_accumulation_steps
    steps_in_epoch = len(run.train_loader)
    for epoch in range(epochs_trained, epochs):
        run.control = run.handler.on_epoch_begin(args, state, run.control)
        loader, step, done_updates, rng_pending = run.train_loader, -1, 0, False
        if resume and epoch == epochs_trained:
            if skip_batches:
                from accelerate import skip_first_batches

                loader = skip_first_batches(run.train_loader, skip_batches)
                step, done_updates, rng_pending = skip_batches - 1, skip_batches // accum, True
            else:
                load_rng(Path(resume))
        _set_epoch(loader, epoch)
        batches_iter = iter(loader)
        remainder = steps_in_epoch % accum or accum
        for update in range(done_updates, steps_per_epoch):
            batches = list(islice(batches_iter, accum if update != steps_per_epoch - 1 else remainder))
            if rng_pending:
                load_rng(Path(resume))
                rng_pending = False
            if not batches:
                run.control.should_training_stop = True
                break
            run.control = run.handler.on_step_begin(args, state, run.control)
            step += len(batches)
            loss, grad_norm, lr = _train_step(run, batches)
            if args.logging_nan_inf_filter and not math.isfinite(loss):
                loss = run.window_loss / (1 + state.global_step - run.last_logged)  # the Trainer's filter
            state.global_step += 1
            state.epoch = epoch + (step + 1) / steps_in_epoch
            run.window_loss += loss
            run.total_loss += loss
            run.control = run.handler.on_step_end(args, state, run.control)
            _stop_after_step(run)
            _maybe_log_save_evaluate(run, grad_norm, lr)
            if math.isnan(grad_norm):  # the update was dropped (after the step's own log: on_log resets should_log)
                run.nonfinite_steps.append(state.global_step)
                _log(run, {"nonfinite_steps_skipped": float(len(run.nonfinite_steps))})
            if run.control.should_epoch_stop or run.control.should_training_stop:
                break
        run.control = run.handler.on_epoch_end(args, state, run.control)
        _maybe_log_save_evaluate(run, None, None)
        if run.control.should_training_stop:
            break


def _set_epoch(loader: Any, epoch: int) -> None:
    """The Trainer's two calls: accelerate's loader, and a sampler wrapped in ``BatchSamplerShard``."""
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    underlying = getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)
    if hasattr(underlying, "set_epoch"):
        underlying.set_epoch(epoch)


def _train_step(run: Run, batches: list[dict[str, torch.Tensor]]) -> tuple[float, float, float]:
    """One optimizer step: the strategy's forward / backward / reduction, the stop rules, clipping, update."""
    args = run.args
    loss = run.step.forward_backward(batches)
    if _guard(run):
        grad_norm = float("nan")
    else:
        grad_norm = run.step.clip_gradients(args.max_grad_norm)
    run.control = run.handler.on_pre_optimizer_step(args, run.state, run.control)
    run.optimizer.step()
    if run.state_bytes is None and not math.isnan(grad_norm):  # the one moment params, grads and state all exist
        run.state_bytes = model_state_bytes(run.step.module, run.optimizer)
    run.control = run.handler.on_optimizer_step(args, run.state, run.control)
    lr = run.scheduler.get_last_lr()[0]
    with warnings.catch_warnings():  # a dropped first update: torch warns the schedule runs ahead; it should
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
        run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm, lr


def _guard(run: Run) -> bool:
    """hftk.engine.resilience's rules, agreed by every rank: a non-finite gradient drops the update (step and
    schedule still advance); preemption or ``nan_policy=stop`` saves after this step and exits."""
    params = [p for _, p in run.step.params]
    nonfinite, stop = decide_step(run.signal, nonfinite_gradients(params), run.prepared.cfg.resilience.nan_policy,
                                  run.step.device)
    if nonfinite:
        for p in params:
            p.grad = None  # torch optimizers skip parameters without a gradient
    if stop is not None and run.exit_code is None:
        run.exit_code, run.stop_reason = stop
    return nonfinite


def _stop_after_step(run: Run) -> None:
    if run.exit_code is not None:
        run.control.should_save = True
        run.control.should_training_stop = True


def _stop(run: Run) -> None:
    """As ``hftk.engine.resilience.raise_stop`` on the Trainer path: say where the run stopped, tear down, exit."""
    if run.rank == 0:
        saved = run.prepared.cfg.output_dir / f"checkpoint-{run.state.global_step}"
        print(stop_line(run.state.global_step, run.stop_reason, saved, run.exit_code), file=sys.stderr, flush=True)
    run.signal.leave()
    dist.barrier()
    dist.destroy_process_group()
    raise SystemExit(run.exit_code)


def _maybe_log_save_evaluate(run: Run, grad_norm: float | None, lr: float | None) -> None:
    args, state = run.args, run.state
    if run.control.should_log and state.global_step > run.last_logged:
        logs = {"loss": run.window_loss / (state.global_step - run.last_logged)}
        if grad_norm is not None:
            logs["grad_norm"] = grad_norm
        logs["learning_rate"] = lr if lr is not None else run.scheduler.get_last_lr()[0]
        run.window_loss, run.last_logged = 0.0, state.global_step
        _log(run, logs)
    if run.control.should_evaluate and run.eval_set is not None and run.exit_code is None:
        _evaluate_unless_preempted(run)  # skipped after a preemption: the grace period is for the save
    if run.control.should_save:
        _save_checkpoint(run)
        run.control = run.handler.on_save(args, state, run.control)


def _log(run: Run, logs: dict[str, float]) -> None:
    """``Trainer.log``: epoch added, history kept, every callback told."""
    if run.state.epoch is not None:
        logs["epoch"] = run.state.epoch
    run.state.log_history.append({**logs, "step": run.state.global_step})
    run.control = run.handler.on_log(run.args, run.state, run.control, logs)


def _log_layout(run: Run) -> None:
    """Once, on rank 0: how the strategy laid the run out, and what each parameter looks like on this rank."""
    if run.rank == 0:
        append_jsonl(run.metrics_path, {
            "step": run.state.global_step,
            "layout": {**run.step.describe, "world_size": dist.get_world_size(), "global_batch": run.global_batch,
                       "max_steps": run.state.max_steps},
            "local_shapes": local_shapes(run.step.params)})


def _describe_to_wandb(run: Run) -> None:
    """wandb's run config (the Trainer's arguments and model config, from its callback) gains the strategy
    and its layout, so runs of different layouts compare side by side."""
    if "wandb" in run.args.report_to and run.rank == 0:
        import wandb

        if wandb.run is not None:
            wandb.run.config.update({"strategy": run.prepared.cfg.strategy.strategy, **run.step.describe},
                                    allow_val_change=True)


def _log_memory(run: Run) -> None:
    """Every rank's model state (counted at its first optimizer step), training-phase and lifetime peak."""
    if run.state_bytes is not None:
        record = gather_objects({**run.state_bytes, "peak": run.monitor.training_peak_bytes(),
                                 "lifetime_peak": run.lifetime_peak})
        if run.rank == 0:
            append_jsonl(run.metrics_path, {"step": run.state.global_step, "memory": record})


def local_shapes(params: list[tuple[str, torch.Tensor]]) -> dict[str, dict[str, Any]]:
    """Per parameter: the shape this rank stores, the full shape, and its placements (sharding made visible)."""
    shapes = {}
    for name, param in params:
        local = param.to_local() if hasattr(param, "to_local") else param
        shapes[name] = {"local": list(local.shape), "full": list(param.shape),
                        "placements": [str(p) for p in getattr(param, "placements", ())]}
    return shapes


@torch.no_grad()
def _evaluate(run: Run) -> dict[str, float]:
    """Loss over the held-out set (every replica its rows), logged as ``eval_loss``: summed token losses
    over summed token counts, each counted by the step's rule (the pipeline: the Trainer's)."""
    start = time.time()
    total = torch.zeros(2, dtype=torch.float64, device=run.step.device)
    for rows in _eval_batches(run):
        total += run.step.eval_sums(rows)
    metrics = {"eval_loss": float(total[0] / total[1].clamp(min=1)), "eval_runtime": round(time.time() - start, 4)}
    _log(run, dict(metrics))
    run.control = run.handler.on_evaluate(run.args, run.state, run.control, metrics=metrics)
    _sample(run)
    return metrics


def _sample(run: Run) -> None:
    """Generation samples at this step, once (the samples options). Collective: the weights are consolidated on
    rank 0 (in host memory; then on the device where they fit, :func:`samples.sampling_device`), which generates,
    writes and reports the rows while the other ranks follow its forwards (a preemption signal on any rank stops
    every rank at the same token, :class:`samples.TokenAgreement`); every rank waits for it here (not in the next
    step's time) and logs ``sample_time_s``."""
    step = run.state.global_step
    if not run.prompts or step in run.sampled:
        return
    run.sampled.add(step)
    start = time.perf_counter()
    agreement = samples.TokenAgreement(run.signal, run.step.device)
    model = run.step.consolidated_model(run.adapter[0] if run.adapter is not None else None)
    if model is None:
        agreement.follow()
    else:
        cfg = run.prepared.cfg
        device = samples.sampling_device(model, run.step.device)
        rows = samples.sample(model.to(device), run.tokenizer, run.prompts, cfg, step, device, shared=False,
                              agreement=agreement)
        report_samples(rows, cfg.output_dir, run.handler.callbacks, run.args, step)
        del model
    _log(run, {"sample_time_s": time.perf_counter() - start})


def _evaluate_unless_preempted(run: Run) -> dict[str, float]:
    """``_evaluate``; when a preemption signal interrupts it, the run saves at this step and stops instead."""
    try:
        return _evaluate(run)
    except EvaluationInterrupted as stop:
        run.exit_code, run.stop_reason = EXIT_PREEMPTED, f"preempted ({stop}) during evaluation"
        _stop_after_step(run)
        return {}


def _finish(run: Run, start: float, start_step: int) -> dict[str, float]:
    """Train summary and final evaluation (unless the last step had one; an interrupted one saves a checkpoint)."""
    state = run.state
    runtime = time.time() - start
    steps = state.global_step - start_step
    samples = steps * run.global_batch
    metrics = {"train_runtime": round(runtime, 4), "train_samples_per_second": round(samples / runtime, 3),
               "train_steps_per_second": round(steps / runtime, 3), "train_loss": run.total_loss / max(steps, 1)}
    _log(run, dict(metrics))
    try:
        _sample(run)  # before the reporters' train end (tensorboard closes its writer there)
    except EvaluationInterrupted as stop:
        run.exit_code, run.stop_reason = EXIT_PREEMPTED, f"preempted ({stop}) during sampling"
    run.control = run.handler.on_train_end(run.args, state, run.control)
    evaluated = logged_eval(state.log_history, state.global_step)
    metrics.update(evaluated)
    if run.exit_code is not None:  # preempted while sampling: saved here, no final evaluation
        _save_checkpoint(run)
    elif run.eval_set is not None and not evaluated:
        metrics.update(_evaluate_unless_preempted(run))
        if run.exit_code is not None:
            _save_checkpoint(run)
    return metrics


def _run_record(run: Run, step: int, metrics: dict[str, float] | None) -> dict[str, Any]:
    """hftk.publish.hub's run record: every process, and the data-parallel replicas the global batch counts."""
    p = run.prepared
    return run_record(p.cfg, run.args, p.world_size, p.data_format, step, metrics, run.step.dp_size)


# ---------------------------------------------------------------------------------------------
# Checkpoints and the final folder
# ---------------------------------------------------------------------------------------------

def _save_checkpoint(run: Run) -> None:
    """``checkpoint-N`` (:class:`hftk.checkpoint.checkpointer.Checkpointer`: staged, sealed, renamed, rotated), then pushed."""
    folder = run.checkpointer.save(run.state.global_step)
    if run.pusher is not None:
        run.pusher.checkpoint_published(folder)


def _write_adapter(step: Any, adapter: tuple[Any, dict[str, tuple[int, ...]]] | None, folder: Path) -> None:
    """Collective under LoRA: every shard's adapter weights (replica 0's, or the step's own gather) gathered; rank 0
    writes the adapter."""
    if adapter is None:
        return
    config, shapes = adapter
    if hasattr(step, "adapter_tensors"):  # sharded adapters (expert parallel): gathered by the step, every rank
        tensors = step.adapter_tensors(set(shapes))
    else:
        mine = {n: p.detach() for n, p in step.params if n in shapes} if step.dp_rank == 0 else {}
        tensors = lora.gather_pieces(mine)
    if dist.get_rank() == 0:
        lora.write_adapter(folder, config, tensors, shapes)


def _save_final(run: Run, metrics: dict[str, float]) -> None:
    """``output_dir/final``: a standard HF folder from the step (with LoRA: the adapter and tokenizer, as
    under every other strategy), with the run record and model card; then pushed. One save
    (:func:`staged_folder`), as in the Trainer engine: a failure on any rank reaches every rank."""
    out = run.prepared.cfg.output_dir / FINAL_DIR
    step = run.state.global_step
    with staged_folder(out, publisher=run.rank == 0, step=step) as final:
        if run.adapter is not None:
            _write_adapter(run.step, run.adapter, final)
            if run.rank == 0:
                run.tokenizer.save_pretrained(final)
        else:
            run.step.save_final(final, run.tokenizer)
        if run.rank == 0:
            write_run_files(final, _run_record(run, step, metrics), run.prepared.cfg.training.get("hub_model_id"))
    if run.pusher is not None:
        run.pusher.push_final(out, step)  # waits; a failed push is reported, not raised
