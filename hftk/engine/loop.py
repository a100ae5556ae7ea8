"""The thin training loop for what the HF Trainer cannot drive: pipeline stages.

Only the forward/backward differs from the Trainer path; everything else is the Trainer's
own machinery or hftk's shared code, so a pipeline run and a Trainer run of the same config
take the same steps:

- ``TrainingArguments`` from :func:`hftk.engine.trainer.build_training_arguments` (it also
  starts the process group: gloo on CPU, NCCL on GPU);
- data from :mod:`hftk.data`, sampled like the Trainer (accelerate's seedable sampler, one
  shard per data-parallel replica, ``skip_first_batches`` on resume);
- the optimizer class, its kwargs and the decay / no-decay groups from the Trainer's own
  ``get_optimizer_cls_and_kwargs`` and ``get_decay_parameter_names``; the schedule from
  ``get_scheduler``;
- the loss normalised by the token count of the whole optimizer step (``num_items_in_batch``);
- flow control (when to log, evaluate, save, stop) from the Trainer's ``TrainerState``,
  ``TrainerControl`` and ``DefaultFlowCallback``; reporting through the same callbacks
  (tensorboard / wandb integrations, hftk's ``MetricsCallback`` writing ``metrics.jsonl``);
- atomic ``checkpoint-N`` folders (:func:`hftk.checkpoint.atomic_save`; ``latest`` resumes)
  holding the Trainer's ``trainer_state.json``, and the final folder through :func:`hftk.export.export`.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hftk import lora, strategies
from hftk.checkpoint import (announce_resume, atomic_save, load_rng, resolve_resume, save_rng, staged_folder,
                             staging_root)
from hftk.comm.collectives import gather_objects
from hftk.data import announce_eval, collator
from hftk.engine.guard import check_world
from hftk.engine.trainer import FINAL_DIR, build_training_arguments, load_data
from hftk.run_record import run_record, save_run_record, write_run_files
from hftk.modeling import load_model
from hftk.monitor import MetricsCallback, append_jsonl, parameter_digest
from hftk.resilience import (EXIT_NONFINITE, EXIT_PREEMPTED, EvaluationInterrupted, PreemptionSignal, agree,
                             nonfinite_gradients, preemptible, signal_name)
from hftk.run_types import PreparedRun
from hftk.telemetry import RankMonitor, RankMonitorCallback, compute_dtype, device_peak_flops, flops_per_token

STATE_FILE = "trainer_state.json"  # the Trainer's own state file (global step, log history)
SCHEDULER_FILE = "scheduler.pt"


@dataclass
class Run:
    """Everything one loop run holds (no behaviour: the functions below act on it)."""

    prepared: PreparedRun
    args: Any
    rt: Any  # hftk.strategies.pipeline.PipelineRuntime
    model_config: Any
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_loader: Any
    eval_loader: Any | None
    state: Any  # transformers.TrainerState
    control: Any  # transformers.TrainerControl
    handler: Any  # transformers CallbackHandler
    metrics_path: Path
    last_logged: int = 0
    window_loss: float = 0.0  # summed step losses since the last log
    total_loss: float = 0.0  # summed step losses of this run (-> train_loss)
    last_sync_check: int = -1
    count_shifted: bool = True  # how the Trainer counts num_items_in_batch for this model
    signal: PreemptionSignal = field(default_factory=PreemptionSignal)
    exit_code: int | None = None  # set when preempted or nan_policy=stop: save, then exit with it
    stop_reason: str = ""
    nonfinite_steps: list[int] = field(default_factory=list)
    adapter: tuple[Any, dict[str, tuple[int, ...]]] | None = None  # LoRA: (PEFT config, each adapter weight's shape)

    @property
    def rank(self) -> int:
        return dist.get_rank()


def train(prepared: PreparedRun) -> dict[str, float]:
    """Entry point for strategies whose table ``engine`` is this module; tears the process group down."""
    metrics = run(prepared)
    # Torn down by us: gloo aborts when the interpreter exits with the group still alive.
    dist.barrier()
    dist.destroy_process_group()
    return metrics


def run(prepared: PreparedRun) -> dict[str, float]:
    """Train one prepared config; leaves the process group up (several runs may share it)."""
    from transformers import set_seed

    cfg = prepared.cfg
    pipeline = strategies.get(cfg.strategy.strategy)
    args = build_training_arguments(prepared, {})
    check_world(args.world_size)
    set_seed(args.seed)
    topo = pipeline.topology(cfg.strategy.pp_size, args.device)

    tokenizer, data = load_data(prepared, args.seed)
    announce_eval(cfg.data, data.eval, args.per_device_eval_batch_size, topo.dp_size, args.process_index == 0)
    model = lora.apply(load_model(cfg.model), cfg, args)
    _enable_activation_checkpointing(model, args)
    decay_ids = _decay_parameter_ids(model)
    count_shifted = _loss_shifts_labels(model)
    token_flops = flops_per_token(model, cfg.data.block_size)
    rt = pipeline.build_runtime(model, cfg.strategy, topo, bf16=bool(args.bf16))
    model_config = model.config
    adapter = (model.peft_config[lora.ADAPTER_NAME], lora.adapter_shapes(model)) if lora.is_peft(model) else None
    del model  # this rank keeps only its stages' modules

    optimizer = _make_optimizer(args, rt.params, decay_ids)
    collate = collator(cfg.data, tokenizer.pad_token_id, fixed_length=cfg.data.block_size)  # stages: fixed shapes
    train_loader = _train_loader(args, data.train, topo, collate)
    max_steps, steps_per_epoch, epochs = _plan_steps(args, len(train_loader))
    scheduler = _make_scheduler(args, optimizer, max_steps)
    run = _start_run(prepared, args, rt, model_config, tokenizer, optimizer, scheduler, train_loader,
                     _eval_loader(args, data.eval, topo, collate) if data.eval is not None else None, max_steps, epochs,
                     token_flops)
    run.count_shifted, run.adapter = count_shifted, adapter
    return _train_epochs(run, pipeline, steps_per_epoch, epochs)


# ---------------------------------------------------------------------------------------------
# Construction (the Trainer's choices, reused)
# ---------------------------------------------------------------------------------------------

def _enable_activation_checkpointing(model: Any, args: Any) -> None:
    """As ``Trainer.train`` does; the blocks then checkpoint themselves inside each stage."""
    if not args.activation_checkpointing:
        return
    kwargs = dict(args.activation_checkpointing_kwargs or {})
    every_n_layers = kwargs.pop("every_n_layers", 1)
    offload = kwargs.pop("offload", False)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None,
                                          every_n_layers=every_n_layers, offload=offload)


def _decay_parameter_ids(model: Any) -> set[int]:
    """Parameters the Trainer applies weight decay to (no bias, no norm), by identity.

    Identity, not name: a tied LM head on the last stage is the same tensor as the
    embedding and must land in the same group on both stages.
    """
    from transformers import Trainer

    names = set(Trainer.get_decay_parameter_names(None, model))  # uses no Trainer state
    return {id(p) for n, p in model.named_parameters() if n in names}


def _make_optimizer(args: Any, params: list[tuple[str, Any]], decay_ids: set[int]) -> torch.optim.Optimizer:
    from transformers import Trainer

    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    trainable = [p for _, p in params if p.requires_grad]
    groups = [{"params": [p for p in trainable if id(p) in decay_ids], "weight_decay": args.weight_decay},
              {"params": [p for p in trainable if id(p) not in decay_ids], "weight_decay": 0.0}]
    return cls(groups, **kwargs)


def _make_scheduler(args: Any, optimizer: torch.optim.Optimizer, max_steps: int) -> Any:
    from transformers import get_scheduler

    return get_scheduler(args.lr_scheduler_type, optimizer=optimizer,
                         num_warmup_steps=args.get_warmup_steps(max_steps), num_training_steps=max_steps,
                         scheduler_specific_kwargs=args.lr_scheduler_kwargs)


def _train_loader(args: Any, dataset: Any, topo: Any, collate: Any) -> Any:
    """The Trainer's train loader, sharded over data-parallel replicas instead of all ranks."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader, RandomSampler

    loader = DataLoader(dataset, batch_size=args.per_device_train_batch_size, sampler=RandomSampler(dataset),
                        collate_fn=collate, drop_last=args.dataloader_drop_last,
                        num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory)
    acc = args.accelerator_config
    return prepare_data_loader(loader, device=None, num_processes=topo.dp_size, process_index=topo.dp_rank,
                               split_batches=acc.split_batches, put_on_device=False, rng_types=None,
                               even_batches=acc.even_batches, use_seedable_sampler=acc.use_seedable_sampler,
                               data_seed=args.data_seed)


def _eval_loader(args: Any, dataset: Any, topo: Any, collate: Any) -> Any:
    """Each replica evaluates its own contiguous shard; losses and token counts are summed after."""
    from torch.utils.data import DataLoader

    shard = dataset.shard(num_shards=topo.dp_size, index=topo.dp_rank, contiguous=True)
    return DataLoader(shard, batch_size=args.per_device_eval_batch_size, collate_fn=collate)


def _plan_steps(args: Any, batches_per_epoch: int) -> tuple[int, int, int]:
    """(max_steps, optimizer steps per epoch, epochs) exactly as ``Trainer.set_initial_training_values``."""
    accum = args.gradient_accumulation_steps
    per_epoch = max(batches_per_epoch // accum + int(batches_per_epoch % accum > 0), 1)
    if args.max_steps > 0:
        return args.max_steps, per_epoch, args.max_steps // per_epoch + int(args.max_steps % per_epoch > 0)
    return math.ceil(args.num_train_epochs * per_epoch), per_epoch, math.ceil(args.num_train_epochs)


def _start_run(prepared: PreparedRun, args: Any, rt: Any, model_config: Any, tokenizer: Any, optimizer: Any,
               scheduler: Any, train_loader: Any, eval_loader: Any, max_steps: int, epochs: int,
               token_flops: float) -> Run:
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
    samples_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * rt.topo.dp_size
    metrics_path = cfg.output_dir / cfg.tracking.metrics_file
    tokens_per_step = samples_per_step * cfg.data.block_size
    peak = device_peak_flops(args.device, compute_dtype(args.bf16, args.fp16))
    metrics_cb = MetricsCallback(metrics_path, tokens_per_step=tokens_per_step, samples_per_step=samples_per_step,
                                 flops_per_step=tokens_per_step * token_flops,
                                 peak_flops=peak * dist.get_world_size() if peak else None)
    # Per-rank memory, comm share and step times (no model handed over: no compute-time imbalance).
    monitor = RankMonitorCallback(RankMonitor(args.device, cfg.tracking.imbalance_warn_threshold,
                                              cfg.tracking.comm_profile_steps), metrics_path)
    callbacks = [monitor, metrics_cb, DefaultFlowCallback, *get_reporting_integration_callbacks(args.report_to)]
    handler = CallbackHandler(callbacks, None, tokenizer, optimizer, scheduler)
    return Run(prepared=prepared, args=args, rt=rt, model_config=model_config, tokenizer=tokenizer,
               optimizer=optimizer, scheduler=scheduler, train_loader=train_loader, eval_loader=eval_loader,
               state=state, control=TrainerControl(), handler=handler, metrics_path=metrics_path)


# ---------------------------------------------------------------------------------------------
# The loop (the shape of Trainer._inner_training_loop / _run_epoch)
# ---------------------------------------------------------------------------------------------

def _train_epochs(run: Run, pipeline: Any, steps_per_epoch: int, epochs: int) -> dict[str, float]:
    args, state = run.args, run.state
    accum = args.gradient_accumulation_steps
    resume = resolve_resume(run.prepared.cfg.output_dir, run.prepared.cfg.training.get("resume_from_checkpoint"))
    epochs_trained, skip_batches = 0, 0
    announce_resume(run.prepared.cfg.output_dir, resume, run.rank == 0)
    if run.rank == 0:  # what `hftk push checkpoint-N` writes the model card from
        save_run_record(run.prepared.cfg.output_dir, _run_record(run, 0, None))
    if resume:
        _load_checkpoint(run, pipeline, Path(resume))
        epochs_trained = state.global_step // steps_per_epoch
        skip_batches = (state.global_step % steps_per_epoch) * accum
    run.last_logged = state.global_step
    start, start_step = time.time(), state.global_step
    run.control = run.handler.on_train_begin(args, state, run.control)
    with run.signal.watching():  # through the final evaluation: a signal there interrupts it
        _run_epochs(run, pipeline, resume, steps_per_epoch, epochs, epochs_trained, skip_batches)
        metrics = _finish(run, pipeline, start, start_step) if run.exit_code is None else {}
    if run.exit_code is not None:
        _stop(run)
    _save_final(run, pipeline, metrics)
    return metrics


def _run_epochs(run: Run, pipeline: Any, resume: str | None, steps_per_epoch: int, epochs: int,
                epochs_trained: int, skip_batches: int) -> None:
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
            loss, grad_norm, lr = _train_step(run, pipeline, batches)
            if args.logging_nan_inf_filter and not math.isfinite(loss):
                loss = run.window_loss / (1 + state.global_step - run.last_logged)  # the Trainer's filter
            state.global_step += 1
            state.epoch = epoch + (step + 1) / steps_in_epoch
            run.window_loss += loss
            run.total_loss += loss
            run.control = run.handler.on_step_end(args, state, run.control)
            _stop_after_step(run)
            _maybe_log_save_evaluate(run, pipeline, grad_norm, lr)
            if math.isnan(grad_norm):  # the update was dropped (after the step's own log: on_log resets should_log)
                run.nonfinite_steps.append(state.global_step)
                _log(run, {"nonfinite_steps_skipped": float(len(run.nonfinite_steps))})
            if run.control.should_epoch_stop or run.control.should_training_stop:
                break
        run.control = run.handler.on_epoch_end(args, state, run.control)
        _maybe_log_save_evaluate(run, pipeline, None, None)
        if run.control.should_training_stop:
            break


def _set_epoch(loader: Any, epoch: int) -> None:
    """The Trainer's two calls: accelerate's loader, and a sampler wrapped in ``BatchSamplerShard``."""
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    underlying = getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)
    if hasattr(underlying, "set_epoch"):
        underlying.set_epoch(epoch)


def _pad_rows(batch: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """Append copies of row 0 with every label ignored, so a short batch still splits into equal micro-batches.

    The loss is divided by the count of real labels, so padded rows change nothing.
    """
    batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}  # bfd's use_cache flag: stages keep none
    extra = rows - batch["input_ids"].shape[0]
    if extra <= 0:
        return batch
    out = {k: torch.cat([v, v[:1].expand(extra, *v.shape[1:])]) for k, v in batch.items()}
    out["labels"][-extra:] = -100
    return out


def _loss_shifts_labels(model: Any) -> bool:
    """The Trainer's own rule for counting ``num_items_in_batch`` (``Trainer._loss_shifts_labels``).

    Only a model whose ``loss_type`` maps to ``ForCausalLMLoss`` gets its labels counted
    shifted by one; others (hftk's built-ins, whose config leaves ``loss_type`` unset) count
    every label. Parity with a Trainer run needs the same divisor, so the rule is mirrored.
    """
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    return (LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss
            and not getattr(model.config, "is_encoder_decoder", False))


def _label_count(batch: dict[str, torch.Tensor], shifted: bool) -> torch.Tensor:
    labels = batch["labels"][..., 1:] if shifted else batch["labels"]
    return labels.ne(-100).sum()


def _train_step(run: Run, pipeline: Any, batches: list[dict[str, torch.Tensor]]) -> tuple[float, float, float]:
    """All accumulation batches through the pipeline, gradients synchronised, clipped, one optimizer step."""
    rt, args = run.rt, run.args
    device = rt.topo.device
    tokens = sum(_label_count(b, run.count_shifted) for b in batches).to(device).reshape(1)
    if rt.topo.dp_size > 1:
        dist.all_reduce(tokens, group=rt.topo.dp_group)
    divisor = tokens[0] / 1  # a float tensor, as the Trainer's num_items_in_batch
    rows = pipeline.microbatch_rows(args.per_device_train_batch_size, rt.microbatches)
    loss = torch.zeros((), device=device)
    for batch in batches:
        loss = loss + pipeline.forward_backward(rt, _pad_rows(batch, rows), divisor)
    pipeline.reduce_gradients(rt)
    if _guard(run):
        grad_norm = torch.tensor(float("nan"))
    else:
        grad_norm = pipeline.clip_gradients(rt, args.max_grad_norm)
    run.control = run.handler.on_pre_optimizer_step(args, run.state, run.control)
    run.optimizer.step()
    run.control = run.handler.on_optimizer_step(args, run.state, run.control)
    lr = run.scheduler.get_last_lr()[0]
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    total = loss.reshape(1).clone()
    dist.all_reduce(total)  # only the last stage of each replica holds a loss
    return float(total[0]), float(grad_norm), lr


def _guard(run: Run) -> bool:
    """hftk.resilience's rules, agreed by every rank: a non-finite gradient drops the update (step and
    schedule still advance); preemption or ``nan_policy=stop`` saves after this step and exits."""
    preempted, nonfinite = agree([run.signal.received is not None,
                                  nonfinite_gradients(p for _, p in run.rt.params)], run.rt.topo.device)
    if nonfinite:
        for _, p in run.rt.params:
            p.grad = None  # torch optimizers skip parameters without a gradient
        if run.prepared.cfg.resilience.nan_policy == "stop" and run.exit_code is None:
            run.exit_code, run.stop_reason = EXIT_NONFINITE, "a NaN/Inf loss (resilience.nan_policy=stop)"
    if preempted and run.exit_code is None:
        run.exit_code, run.stop_reason = EXIT_PREEMPTED, f"preempted ({signal_name(run.signal)})"
    return nonfinite


def _stop_after_step(run: Run) -> None:
    if run.exit_code is not None:
        run.control.should_save = True
        run.control.should_training_stop = True


def _stop(run: Run) -> None:
    """Like ``hftk.resilience.stop_if_interrupted``: say where the run stopped, tear down, exit with the code."""
    import sys

    if run.rank == 0:
        print(f"hftk: stopped at step {run.state.global_step}: {run.stop_reason}; saved "
              f"{run.prepared.cfg.output_dir / f'checkpoint-{run.state.global_step}'}; continue with "
              f"--resume_from_checkpoint latest (exit {run.exit_code})", file=sys.stderr, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    raise SystemExit(run.exit_code)


def _maybe_log_save_evaluate(run: Run, pipeline: Any, grad_norm: float | None, lr: float | None) -> None:
    args, state = run.args, run.state
    if run.control.should_log and state.global_step > run.last_logged:
        logs = {"loss": run.window_loss / (state.global_step - run.last_logged)}
        if grad_norm is not None:
            logs["grad_norm"] = grad_norm
        logs["learning_rate"] = lr if lr is not None else run.scheduler.get_last_lr()[0]
        run.window_loss, run.last_logged = 0.0, state.global_step
        _log(run, logs)
    if run.control.should_evaluate and run.eval_loader is not None and run.exit_code is None:
        _evaluate_unless_preempted(run, pipeline)  # skipped after a preemption: the grace period is for the save
    if run.control.should_save:
        _save_checkpoint(run, pipeline)
        run.control = run.handler.on_save(args, state, run.control)
    every = run.prepared.cfg.tracking.check_sync_steps
    if every > 0 and state.global_step % every == 0 and state.global_step != run.last_sync_check:
        run.last_sync_check = state.global_step
        _check_replicas(run)


def _log(run: Run, logs: dict[str, float]) -> None:
    """``Trainer.log``: epoch added, history kept, every callback told."""
    if run.state.epoch is not None:
        logs["epoch"] = run.state.epoch
    run.state.log_history.append({**logs, "step": run.state.global_step})
    run.control = run.handler.on_log(run.args, run.state, run.control, logs)


def _evaluate(run: Run, pipeline: Any) -> dict[str, float]:
    """Loss over the held-out set (every replica its shard), logged as ``eval_loss``.

    Summed token losses over summed label counts (counted by the Trainer's rule). With packed
    blocks this is exactly the Trainer's ``eval_loss``; with padded examples the Trainer instead
    averages per-batch means, which weighs short examples differently.
    """
    rt, start = run.rt, time.time()
    rows = pipeline.microbatch_rows(run.args.per_device_eval_batch_size, rt.microbatches)
    total = torch.zeros(2, dtype=torch.float64, device=rt.topo.device)
    for batch in preemptible(run.eval_loader, run.signal, rt.topo.device):
        loss_sum = pipeline.evaluate_batch(rt, _pad_rows(batch, rows))
        if rt.holds_last:
            count = float(_label_count(batch, run.count_shifted))
            total += torch.tensor([float(loss_sum), count], dtype=torch.float64, device=rt.topo.device)
    dist.all_reduce(total)
    metrics = {"eval_loss": float(total[0] / total[1]), "eval_runtime": round(time.time() - start, 4)}
    _log(run, dict(metrics))
    run.control = run.handler.on_evaluate(run.args, run.state, run.control, metrics=metrics)
    return metrics


def _evaluate_unless_preempted(run: Run, pipeline: Any) -> dict[str, float]:
    """``_evaluate``; when a preemption signal interrupts it, the run saves at this step and stops instead."""
    try:
        return _evaluate(run, pipeline)
    except EvaluationInterrupted as stop:
        run.exit_code, run.stop_reason = EXIT_PREEMPTED, f"preempted ({stop}) during evaluation"
        _stop_after_step(run)
        return {}


def _check_replicas(run: Run) -> None:
    """Replicas of each stage must hold bitwise-equal weights; logged as ``ranks_in_sync``."""
    digests = gather_objects((run.rt.topo.pp_rank, parameter_digest(torch.nn.ModuleList(run.rt.stages))))
    if run.rank == 0:
        by_stage: dict[int, set[str]] = {}
        for pp_rank, d in digests:
            by_stage.setdefault(pp_rank, set()).add(d)
        append_jsonl(run.metrics_path, {"step": run.state.global_step,
                                        "ranks_in_sync": all(len(v) == 1 for v in by_stage.values()),
                                        "param_digests": [d for _, d in digests]})


def _finish(run: Run, pipeline: Any, start: float, start_step: int) -> dict[str, float]:
    """Train summary and final evaluation (unless the last step had one; an interrupted one saves a checkpoint)."""
    state = run.state
    runtime = time.time() - start
    steps = state.global_step - start_step
    samples = steps * run.args.per_device_train_batch_size * run.args.gradient_accumulation_steps * run.rt.topo.dp_size
    metrics = {"train_runtime": round(runtime, 4), "train_samples_per_second": round(samples / runtime, 3),
               "train_steps_per_second": round(steps / runtime, 3), "train_loss": run.total_loss / max(steps, 1)}
    _log(run, dict(metrics))
    run.control = run.handler.on_train_end(run.args, state, run.control)
    evaluated = any("eval_loss" in h and h["step"] == state.global_step for h in state.log_history)
    if run.eval_loader is not None and not evaluated:
        metrics.update(_evaluate_unless_preempted(run, pipeline))
        if run.exit_code is not None:
            _save_checkpoint(run, pipeline)
    return metrics


def _run_record(run: Run, step: int, metrics: dict[str, float] | None) -> dict[str, Any]:
    """hftk.hub's run record: every process, and the data-parallel replicas the global batch counts."""
    p = run.prepared
    return run_record(p.cfg, run.args, p.world_size, p.data_format, step, metrics, run.rt.topo.dp_size)


# ---------------------------------------------------------------------------------------------
# Checkpoints: per-stage weights and optimizer, scheduler, per-rank RNG, trainer_state.json last
# ---------------------------------------------------------------------------------------------

def _write_stage_files(run: Run, pipeline: Any, folder: Path, with_optimizer: bool) -> None:
    """This rank's part of a checkpoint (or of the final stages) inside ``folder``."""
    pipeline.save_state(run.rt, run.optimizer if with_optimizer else None, folder)
    if run.adapter is not None:
        _write_adapter(run, folder)
    if with_optimizer:
        save_rng(folder)
    if run.rank == 0:
        manifest = pipeline.manifest(run.rt, run.prepared.cfg.strategy.pp_schedule)
        (folder / pipeline.MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        run.model_config.save_pretrained(folder)
        run.tokenizer.save_pretrained(folder)
        if with_optimizer:
            torch.save(run.scheduler.state_dict(), folder / SCHEDULER_FILE)
            run.state.save_to_json(str(folder / STATE_FILE))


def _save_checkpoint(run: Run, pipeline: Any) -> None:
    """``checkpoint-N``, atomic (:func:`hftk.checkpoint.atomic_save`): staged, sealed, renamed, rotated."""
    atomic_save(run.prepared.cfg.output_dir, run.state.global_step,
                lambda folder: _write_stage_files(run, pipeline, folder, with_optimizer=True),
                run.args.save_total_limit)


def _load_checkpoint(run: Run, pipeline: Any, folder: Path) -> None:
    from transformers import TrainerState

    pipeline.load_state(run.rt, run.optimizer, folder)
    run.scheduler.load_state_dict(torch.load(folder / SCHEDULER_FILE, weights_only=True))
    saved = TrainerState.load_from_json(str(folder / STATE_FILE))
    for key in ("global_step", "epoch", "log_history", "total_flos", "best_metric", "best_global_step"):
        setattr(run.state, key, getattr(saved, key))


def _write_adapter(run: Run, folder: Path) -> None:
    """Collective: every stage's LoRA weights (replica 0's) gathered; rank 0 writes the complete adapter."""
    config, shapes = run.adapter
    mine = {n: p.detach() for n, p in run.rt.params if n in shapes} if run.rt.topo.dp_rank == 0 else {}
    tensors = lora.gather_pieces(mine)
    if run.rank == 0:
        lora.write_adapter(folder, config, tensors, shapes)


def _save_final(run: Run, pipeline: Any, metrics: dict[str, float]) -> None:
    """``output_dir/final``: the stages written once more, consolidated by the export into one HF folder
    (with LoRA: the adapter and tokenizer, as under every other strategy)."""
    from hftk.export import export

    out = run.prepared.cfg.output_dir
    if run.adapter is not None:
        with staged_folder(out / FINAL_DIR, publisher=run.rank == 0, step=run.state.global_step) as final:
            _write_adapter(run, final)
            if run.rank == 0:
                run.tokenizer.save_pretrained(final)
                write_run_files(final, _run_record(run, run.state.global_step, metrics),
                                run.prepared.cfg.training.get("hub_model_id"))
        return
    stages = staging_root(out) / "final-stages"
    if run.rank == 0:
        shutil.rmtree(stages, ignore_errors=True)
        stages.mkdir(parents=True)
    dist.barrier()
    _write_stage_files(run, pipeline, stages, with_optimizer=False)
    dist.barrier()
    with staged_folder(out / FINAL_DIR, publisher=run.rank == 0, step=run.state.global_step) as final:
        if run.rank == 0:
            export(stages, final)
            shutil.rmtree(stages)
            write_run_files(final, _run_record(run, run.state.global_step, metrics),
                            run.prepared.cfg.training.get("hub_model_id"))
