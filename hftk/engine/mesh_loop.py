"""A thin training loop for layouts the HF Trainer cannot drive: tensor, context and sequence parallel.

Why not the Trainer here: on CPU accelerate refuses its ``ParallelismConfig``, and a plain
``Accelerator`` wraps a tensor-parallel model in DDP and crashes ("mixed torch.Tensor and
DTensor"); the Trainer gives every rank different samples, while the ranks of one tensor-,
context- or sequence-parallel group must read the same ones; and it cannot checkpoint DTensor optimizer
state (it refuses to resume models sharded at load time). The loop does what the Trainer does
for a causal LM -- shuffled batches, AdamW, warmup + decay, clipping, bf16 autocast, activation
checkpointing, logging (metrics.jsonl, tensorboard, wandb) with per-rank telemetry, evaluation, checkpoints, a final HF
folder -- while the strategy's :class:`MeshLayout` decides who reads which
tokens and how losses and gradients are combined.

The loss of one optimizer step is the mean over every target token of the global batch (all
micro-batches, all data-parallel ranks), as the Trainer computes it: each rank adds its
token-loss sum divided by the global token count, and the gradient reductions sum the parts.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hftk import strategies
from hftk.checkpoint import announce_resume, resolve_resume
from hftk.comm.collectives import gather_objects
from hftk.data import IGNORE_INDEX, announce_eval, collator
from hftk.engine.guard import check_world
from hftk.engine.trainer import load_data
from hftk.errors import HftkError
from hftk.memory import model_state_bytes
from hftk.modeling import load_model
from hftk.monitor import append_jsonl
from hftk.resilience import (EXIT_NONFINITE, EXIT_PREEMPTED, EvaluationInterrupted, PreemptionSignal, agree,
                             nonfinite_gradients, preemptible, signal_name)
from hftk.run_record import run_record, save_run_record, write_run_files
from hftk.run_types import PreparedRun
from hftk.strategies.mesh import MeshLayout, device_type
from hftk.telemetry import RankMonitor, peak_memory_bytes

FINAL_DIR = "final"


# ---------------------------------------------------------------- process group


def init_process_group(cfg: Any) -> int:
    """Start the default process group (gloo on CPU, NCCL on GPU); a single process gets a local store."""
    if dist.is_initialized():
        return dist.get_world_size()
    timeout = timedelta(seconds=int(cfg.args.ddp_timeout))
    if device_type(cfg) == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(timeout=timeout)
    else:
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    check_world(dist.get_world_size())
    return dist.get_world_size()


def all_reduce_sum(value: torch.Tensor, groups: list[Any]) -> torch.Tensor:
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(value, group=group)
    return value


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (replicated scalars, gathered shards); a plain tensor as is."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


# ---------------------------------------------------------------- data


def global_batches(n_samples: int, global_batch: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch's shuffled sample indices cut into full global batches (the remainder is dropped)."""
    generator = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(n_samples, generator=generator).tolist()
    return [order[i:i + global_batch] for i in range(0, n_samples - global_batch + 1, global_batch)]


def rank_slice(indices: list[int], micro: int, rank: int) -> list[int]:
    return indices[rank * micro:(rank + 1) * micro]


def make_batch(dataset: Any, indices: list[int], device: str, collate: Any) -> dict[str, torch.Tensor]:
    """Model inputs plus ``shift_labels`` (the next token per position; -100 where none); ``collate`` is
    :func:`hftk.data.collator` at ``block_size`` (every rank and shard sees the same shape). Position ids
    are the collator's under packing bfd (restarting per example, no attention mask: the model masks
    across examples from them), else 0.. along each row."""
    rows = collate([dataset[i] for i in indices])
    input_ids = rows["input_ids"].to(device)
    labels = rows["labels"].to(device)
    positions = rows.get("position_ids")
    batch = {
        "input_ids": input_ids,
        "position_ids": (torch.arange(input_ids.shape[1]).expand_as(input_ids) if positions is None
                         else positions).to(device),
        "shift_labels": F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX),
    }
    if "attention_mask" in rows:
        batch["attention_mask"] = rows["attention_mask"].to(device)
    return batch


def token_count(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["shift_labels"] != IGNORE_INDEX).sum().to(torch.float64)


# ---------------------------------------------------------------- optimisation


def build_optimizer(model: torch.nn.Module, training: SimpleNamespace) -> torch.optim.Optimizer:
    """AdamW; biases and norms (1-D parameters) without weight decay, one group per device mesh.

    Parameters on different meshes (tensor-parallel shards next to replicated norms) cannot share
    one foreach kernel call, so they get separate groups.
    """
    groups: dict[tuple[bool, Any], list[torch.nn.Parameter]] = {}
    for param in model.parameters():
        if param.requires_grad:
            groups.setdefault((param.ndim >= 2, getattr(param, "device_mesh", None)), []).append(param)
    decay = training.weight_decay
    param_groups = [{"params": params, "weight_decay": decay if decays else 0.0}
                    for (decays, _), params in groups.items()]
    return torch.optim.AdamW(
        param_groups, lr=training.learning_rate, eps=training.adam_epsilon,
        betas=(training.adam_beta1, training.adam_beta2),
        fused=True if training.optim == "adamw_torch_fused" else None,
    )


def build_scheduler(optimizer: torch.optim.Optimizer, training: SimpleNamespace, max_steps: int) -> Any:
    from transformers import get_scheduler

    warmup = training.warmup_steps
    warmup = int(warmup) if warmup >= 1 else math.ceil(max_steps * warmup)
    return get_scheduler(training.lr_scheduler_type, optimizer, num_warmup_steps=warmup,
                         num_training_steps=max_steps)


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Global gradient norm over parameters on any mix of meshes; grads scaled down to ``max_norm``."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for param in model.parameters():
        if param.grad is not None:
            groups.setdefault(getattr(param.grad, "device_mesh", None), []).append(param.grad)
    squares = [plain(torch.nn.utils.get_total_norm(grads)) ** 2 for grads in groups.values()]
    total = float(torch.stack(squares).sum().sqrt()) if squares else 0.0
    if max_norm and max_norm > 0 and total > max_norm:
        coef = max_norm / (total + 1e-6)
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)
    return total


def set_gradient_sync(model: torch.nn.Module, enabled: bool) -> None:
    """FSDP2: reduce-scatter only after the last micro-batch of a gradient-accumulation window."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor], autocast_dtype: torch.dtype | None = None
             ) -> torch.Tensor:
    """Sum of next-token cross-entropy over this rank's target tokens (logits may be vocabulary-sharded).

    ``autocast_dtype``: the forward runs under autocast to it (the Trainer's ``--bf16``); the
    loss is computed in fp32 either way.
    """
    inputs = {k: v for k, v in batch.items() if k != "shift_labels"}
    device = batch["input_ids"].device.type
    with torch.autocast(device, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        logits = model(**inputs, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["shift_labels"].flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)


def train_step(layout: MeshLayout, micro_batches: list[dict[str, torch.Tensor]], optimizer: Any, scheduler: Any,
               max_grad_norm: float, count_memory: bool = False,
               signalled: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """One optimizer step over this rank's micro-batches; returns the global mean loss and grad norm.

    hftk.resilience's rules, agreed by every rank in one all-reduce: a non-finite gradient on any
    rank drops the update (the step and LR schedule still advance); ``signalled()`` (a preemption
    signal on this rank, read at the agreement, so one that lands during this step's forward and
    backward counts for this step) comes back as ``preempted`` on all of them. ``count_memory``: also this
    rank's bytes of parameters, gradients and optimizer state, counted right after
    ``optimizer.step`` (the one moment all three exist).
    """
    model = layout.model
    model.train()  # from_pretrained returns eval mode; Ulysses and dropout must see training mode
    local = [layout.shard_batch(b) for b in micro_batches]
    tokens = all_reduce_sum(sum(token_count(b) for b in local), layout.data_groups)
    total = torch.zeros((), dtype=torch.float64, device=tokens.device)
    for i, batch in enumerate(local):
        set_gradient_sync(model, i == len(local) - 1)
        with layout.loss_context():
            summed = loss_sum(model, batch, layout.autocast_dtype)
            (summed * (layout.grad_scale / tokens.item())).backward()
        total += plain(summed.detach()).to(torch.float64)
    loss = float(all_reduce_sum(total, layout.data_groups) / tokens)
    layout.reduce_grads()
    preempted, nonfinite = agree([signalled(), nonfinite_gradients(model.parameters())], tokens.device)
    out = {"loss": loss, "grad_norm": None, "memory": None, "skipped": nonfinite, "preempted": preempted}
    if not nonfinite:
        out["grad_norm"] = clip_grad_norm(model, max_grad_norm)
        optimizer.step()
        out["memory"] = model_state_bytes(model, optimizer) if count_memory else None
    with warnings.catch_warnings():  # a dropped first update: torch warns the schedule runs ahead; it should
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return out


@torch.no_grad()
def evaluate(layout: MeshLayout, dataset: Any, batch_size: int, device: str, preemption: PreemptionSignal,
             collate: Any) -> float:
    """Mean next-token loss over every eval sample exactly once, in eval mode.

    Every rank runs the same number of forwards (sharded layouts need all ranks in each
    collective): a rank with no samples left reads one with its labels masked out. A preemption
    signal on any rank stops it before the next batch (:class:`hftk.resilience.EvaluationInterrupted`).
    """
    model = layout.model
    model.eval()
    n = len(dataset)
    span = batch_size * layout.data_size
    total = torch.zeros((), dtype=torch.float64, device=device)
    tokens = torch.zeros((), dtype=torch.float64, device=device)
    for start in preemptible(range(0, n, span), preemption, device):
        chunk = list(range(start, min(start + span, n)))
        mine = rank_slice(chunk, batch_size, layout.data_rank)
        batch = make_batch(dataset, mine or chunk[:1], device, collate)
        if not mine:
            batch["shift_labels"].fill_(IGNORE_INDEX)
        batch = layout.shard_batch(batch)
        with layout.loss_context():
            total += plain(loss_sum(model, batch, layout.autocast_dtype)).to(torch.float64)
        tokens += token_count(batch)
    all_reduce_sum(total, layout.data_groups)
    all_reduce_sum(tokens, layout.data_groups)
    model.train()
    return float(total / tokens.clamp(min=1))


# ---------------------------------------------------------------- logging


class Reporter:
    """metrics.jsonl (always), TensorBoard and wandb (when asked), written by rank 0 only.

    wandb gets the Trainer's metric names (``train/loss``, ``eval/loss``: transformers'
    ``rewrite_logs``) and runs offline without an API key, as on the Trainer path.
    """

    def __init__(self, cfg: Any, run_config: dict[str, Any]) -> None:
        self.path = cfg.output_dir / cfg.tracking.metrics_file
        self.main = dist.get_rank() == 0
        report_to = cfg.training.get("report_to") or []
        report_to = [report_to] if isinstance(report_to, str) else report_to
        self.writer = None
        self.wandb_run = None
        if self.main and "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(cfg.output_dir / "runs"))
        if self.main and "wandb" in report_to:
            import wandb

            from hftk.engine.trainer import configure_wandb

            configure_wandb(cfg, report_to)
            self.wandb_run = wandb.init(project=os.environ["WANDB_PROJECT"], dir=str(cfg.output_dir),
                                        name=cfg.output_dir.name, config=run_config)

    def log(self, record: dict[str, Any]) -> None:
        if not self.main:
            return
        append_jsonl(self.path, record)
        scalars = {key: value for key, value in record.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step"}
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, record.get("step", 0))
            self.writer.flush()
        if self.wandb_run is not None and scalars:
            from transformers.integrations.integration_utils import rewrite_logs

            self.wandb_run.log(rewrite_logs(scalars), step=record.get("step", 0))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


# ---------------------------------------------------------------- the run


@torch.no_grad()
def own_storage(model: torch.nn.Module) -> None:
    """Give every unsharded parameter and buffer memory of its own.

    ``from_pretrained`` maps the safetensors file into memory: one tensor left on the mapping (a
    replicated norm, GPT-2's position table) keeps the whole file mapped, and every page the
    sharding read stays resident (measured: 325 MiB of a 333 MiB GPT-2 on each TP=4 rank).
    """
    seen: set[int] = set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) not in seen and not hasattr(param, "device_mesh"):
                seen.add(id(param))
                param.data = param.data.clone()
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and not hasattr(buffer, "device_mesh"):
                module._buffers[name] = buffer.clone()


def loop_args(cfg: Any) -> SimpleNamespace:
    """The TrainingArguments values this run uses (``cfg.args``; constructing TrainingArguments would start
    accelerate's state), with the loop's own AdamW when ``--optim`` is not given: torch's, not fused.
    ``max_steps`` is set once the data size is known."""
    return SimpleNamespace(**{**vars(cfg.args), "optim": cfg.args.optim if "optim" in cfg.given else "adamw_torch"})


def train(prepared: PreparedRun) -> dict[str, float]:
    """Run a tensor-, context- or sequence-parallel fine-tuning for a prepared (validated) config,
    then tear the process group down (gloo aborts at exit with the group still alive)."""
    result = run(prepared)
    dist.barrier()
    dist.destroy_process_group()
    return result


def run(prepared: PreparedRun) -> dict[str, float]:
    """Train and save ``final``; starts the process group unless one is up, and leaves it up
    (several runs may share one launch: tests/workers/matrix_cells.py)."""
    from transformers import set_seed

    from hftk import hub, mesh_checkpoint

    cfg = prepared.cfg
    t = cfg.training
    init_process_group(cfg)
    main = dist.get_rank() == 0
    kind = device_type(cfg)
    device = "cpu" if kind == "cpu" else f"cuda:{torch.cuda.current_device()}"
    args = loop_args(cfg)
    seed = args.seed
    set_seed(seed)
    tokenizer, data = load_data(prepared, seed)
    collate = collator(cfg.data, tokenizer.pad_token_id, fixed_length=cfg.data.block_size)
    model = load_model(cfg.model).to(device)
    if t.get("gradient_checkpointing") or t.get("activation_checkpointing"):
        # each decoder block recomputed in backward; non-reentrant, the form FSDP2 and DTensors support
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    layout = strategies.get(cfg.strategy.strategy).layout(model, cfg, kind)
    layout = dataclasses.replace(layout, autocast_dtype=torch.bfloat16 if t.get("bf16") else None,
                                 describe={**layout.describe, "bf16": bool(t.get("bf16")),
                                           "activation_checkpointing": model.is_activation_checkpointing})
    own_storage(layout.model)
    optimizer = build_optimizer(layout.model, args)

    micro = t["per_device_train_batch_size"]
    global_batch = micro * args.gradient_accumulation_steps * layout.data_size
    announce_eval(cfg.data, data.eval, args.per_device_eval_batch_size, layout.data_size, main)
    steps_per_epoch = len(data.train) // global_batch
    if steps_per_epoch == 0:
        raise HftkError("training.per_device_train_batch_size",
                        f"one optimizer step needs {global_batch} blocks but the training set has {len(data.train)}.",
                        "lower the batch size or gradient_accumulation_steps, or add data.")
    max_steps = args.max_steps = (args.max_steps if args.max_steps > 0
                                  else math.ceil(args.num_train_epochs * steps_per_epoch))
    scheduler = build_scheduler(optimizer, args, max_steps)
    reporter = Reporter(cfg, {"strategy": cfg.strategy.strategy, **layout.describe,
                              **{key: value if isinstance(value, (bool, int, float, str)) else str(value)
                                 for key, value in t.items()}})

    def record(step: int, metrics: dict[str, float]) -> dict[str, Any]:
        return run_record(cfg, args, dist.get_world_size(), prepared.data_format, step, metrics, layout.data_size)

    pusher = hub.RunPusher(cfg, args, dist.get_world_size(), prepared.data_format, reporter.path, layout.data_size) \
        if main and t.get("push_to_hub") else None
    step = 0
    resume = resolve_resume(cfg.output_dir, t.get("resume_from_checkpoint"))
    announce_resume(cfg.output_dir, resume, publisher=main, world_size=dist.get_world_size())
    if resume:
        step = mesh_checkpoint.load(Path(resume), layout, optimizer, scheduler)
    if main:  # what `hftk push checkpoint-N` writes the model card from
        save_run_record(cfg.output_dir, record(0, {}))
    reporter.log({"step": step, "layout": {**layout.describe, "world_size": dist.get_world_size(),
                                           "global_batch": global_batch, "max_steps": max_steps},
                  "local_shapes": local_shapes(layout.model)})

    def save(at: int) -> None:
        folder = mesh_checkpoint.save(cfg.output_dir, at, layout, optimizer, scheduler, cfg, tokenizer)
        if pusher is not None:
            pusher.checkpoint_published(folder)

    lifetime_peak = peak_memory_bytes(torch.device(device))  # imports, loading, sharding
    # per-rank step / compute / CPU time, memory and comm share per logging window, as on the Trainer path
    monitor = RankMonitor(torch.device(device), cfg.tracking.imbalance_warn_threshold, cfg.tracking.comm_profile_steps)
    monitor.attach(layout.model)  # also resets the peak: from here on it is the training phase's
    state_bytes: dict[str, int] | None = None
    window: list[dict[str, float]] = []
    result: dict[str, float] = {}
    evaluated_at = -1
    skipped = 0
    signal = PreemptionSignal()
    signal.install()
    while step < max_steps:
        epoch, offset = divmod(step, steps_per_epoch)
        for indices in global_batches(len(data.train), global_batch, seed, epoch)[offset:]:
            if step >= max_steps:
                break
            started = time.perf_counter()
            span = micro * layout.data_size
            micro_batches = [make_batch(data.train, rank_slice(indices[i:i + span], micro, layout.data_rank), device,
                                        collate)
                             for i in range(0, len(indices), span)]
            lr = scheduler.get_last_lr()[0]
            monitor.step_begin(step + 1)
            out = train_step(layout, micro_batches, optimizer, scheduler, args.max_grad_norm,
                             count_memory=state_bytes is None, signalled=lambda: signal.received is not None)
            monitor.step_end()
            step += 1
            stop, reason = (EXIT_PREEMPTED, f"preempted ({signal_name(signal)})") if out["preempted"] else (None, "")
            if out["skipped"]:
                skipped += 1
                reporter.log({"step": step, "nonfinite_steps_skipped": skipped, "nonfinite_loss": out["loss"]})
                if stop is None and cfg.resilience.nan_policy == "stop":
                    stop, reason = EXIT_NONFINITE, "a NaN/Inf loss (resilience.nan_policy=stop)"
            else:
                state_bytes = state_bytes or out["memory"]
                window.append({"loss": out["loss"], "grad_norm": out["grad_norm"], "learning_rate": lr,
                               "seconds": time.perf_counter() - started})
            if window and (step % args.logging_steps == 0 or step == max_steps):
                summary = monitor.collect(layout.model, optimizer)  # every rank: one all_gather
                ranks = summary.publish(step, reporter.path) if summary is not None else {}
                result = {"train_loss": _log_window(reporter, window, step, steps_per_epoch, global_batch,
                                                    cfg.data.block_size, ranks)}
                window = []
            # skipped after a stop: the grace period is for the save
            if (stop is None and data.eval is not None and t.get("eval_strategy") == "steps"
                    and step % args.eval_steps == 0):
                try:
                    result.update(_log_eval(layout, data.eval, args, device, step, steps_per_epoch, reporter, signal,
                                            collate))
                    evaluated_at = step
                except EvaluationInterrupted as interrupted:
                    stop, reason = EXIT_PREEMPTED, f"preempted ({interrupted}) during evaluation"
            if stop is not None or (args.save_strategy == "steps" and step % args.save_steps == 0):
                save(step)
            if stop is not None:
                _exit(stop, step, cfg.output_dir, reason)
    monitor.detach()
    if state_bytes is not None:
        peak = monitor.training_peak_bytes()  # training phase (the final eval and save excluded)
        reporter.log({"step": step, "memory": gather_objects({**state_bytes, "peak": peak,
                                                              "lifetime_peak": lifetime_peak})})
    if data.eval is not None and evaluated_at != step:
        try:
            result.update(_log_eval(layout, data.eval, args, device, step, steps_per_epoch, reporter, signal, collate))
        except EvaluationInterrupted as interrupted:
            save(step)
            _exit(EXIT_PREEMPTED, step, cfg.output_dir, f"preempted ({interrupted}) during evaluation")
    signal.uninstall()
    final = cfg.output_dir / FINAL_DIR
    mesh_checkpoint.save_hf_folder(final, layout, tokenizer,
                                   lambda folder: write_run_files(folder, record(step, result), t.get("hub_model_id")))
    if pusher is not None:
        pusher.push_final(final, step)  # waits; a failed push is reported, not raised
    reporter.close()
    return result


def _exit(code: int, step: int, output_dir: Path, reason: str) -> None:
    """Like ``hftk.resilience.stop_if_interrupted``: say where the run stopped, tear down, exit with the code."""
    import sys

    if dist.get_rank() == 0:
        print(f"hftk: stopped at step {step}: {reason}; saved {output_dir / f'checkpoint-{step}'}; continue with "
              f"--resume_from_checkpoint latest (exit {code})", file=sys.stderr, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    raise SystemExit(code)


def _log_window(reporter: Reporter, window: list[dict[str, float]], step: int, steps_per_epoch: int,
                global_batch: int, block: int, rank_scalars: dict[str, float]) -> float:
    """One log record for the steps since the last: mean loss, last grad norm and LR, throughput, and the
    rank monitor's scalars (max step time, imbalance, comm share: rank 0 only, like the Trainer's log)."""
    step_time = sum(w["seconds"] for w in window) / len(window)
    loss = sum(w["loss"] for w in window) / len(window)
    reporter.log({"step": step, "epoch": step / steps_per_epoch, "loss": loss, "grad_norm": window[-1]["grad_norm"],
                  "learning_rate": window[-1]["learning_rate"], "step_time_s": step_time,
                  "tokens_per_s": global_batch * block / step_time, "samples_per_s": global_batch / step_time,
                  **rank_scalars})
    return loss


def _log_eval(layout: MeshLayout, dataset: Any, t: SimpleNamespace, device: str, step: int, steps_per_epoch: int,
              reporter: Reporter, preemption: PreemptionSignal, collate: Any) -> dict[str, float]:
    loss = evaluate(layout, dataset, t.per_device_eval_batch_size, device, preemption, collate)
    record = {"step": step, "epoch": step / steps_per_epoch, "eval_loss": loss,
              "eval_perplexity": math.exp(min(loss, 50.0))}
    reporter.log(record)
    return {"eval_loss": loss}


def local_shapes(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Per parameter: the shape this rank stores, the full shape, and its placements (sharding made visible)."""
    shapes = {}
    for name, param in model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        shapes[name] = {"local": list(local.shape), "full": list(param.shape),
                        "placements": [str(p) for p in getattr(param, "placements", ())]}
    return shapes
