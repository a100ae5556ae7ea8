"""The step a mesh strategy (``tp``, ``cp``, ``sp``) hands the custom loop, and its option checks.

Each strategy builds a :class:`MeshLayout` (who reads which tokens, how losses and gradients are
combined); :class:`MeshStep` turns it into what :mod:`hftk.engine.loop` drives: a forward and
backward over one accumulation window, clipping over mixed meshes, evaluation sums, DCP state
(:mod:`hftk.strategies.mesh_checkpoint`) and the gathered final folder.

Why not the Trainer here: on CPU accelerate refuses its ``ParallelismConfig``, and a plain
``Accelerator`` wraps a tensor-parallel model in DDP and crashes ("mixed torch.Tensor and
DTensor"); the ranks of one tensor-, context- or sequence-parallel group must read the same
samples; and it cannot checkpoint DTensor optimizer state.

The loss of one optimizer step is the mean over every target token of the global batch (all
micro-batches, all data-parallel ranks): each rank adds its token-loss sum divided by the global
token count, and the gradient reductions sum the parts.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hftk.core.errors import HftkError
from hftk.data.chat import IGNORE_INDEX

# TrainingArguments fields the loop honours for these strategies; anything else set explicitly is refused before launch.
SUPPORTED_TRAINING = {
    "output_dir", "overwrite_output_dir", "per_device_train_batch_size", "per_device_eval_batch_size",
    "gradient_accumulation_steps", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
    "max_grad_norm", "lr_scheduler_type", "warmup_steps", "num_train_epochs", "max_steps", "logging_steps",
    "eval_strategy", "eval_steps", "save_strategy", "save_steps", "save_total_limit", "seed", "resume_from_checkpoint",
    "report_to", "ddp_timeout", "disable_tqdm", "optim", "use_cpu", "bf16", "gradient_checkpointing",
    "activation_checkpointing",
    "push_to_hub", "hub_model_id", "hub_strategy", "hub_private_repo",
    # DDP / DataLoader options that have nothing to act on in this loop (set by hftk's defaults).
    "ddp_find_unused_parameters", "dataloader_num_workers",
}
CHOICES = {
    "eval_strategy": ("no", "steps"), "save_strategy": ("no", "steps"), "optim": ("adamw_torch", "adamw_torch_fused"),
    "dataloader_num_workers": (0,),
}
REPORTERS = ("none", "tensorboard", "wandb")
# The loop's AdamW when --optim is not given: torch's, not fused (as the plain references these runs are tested against).
LOOP_DEFAULTS = {"optim": "adamw_torch"}


@dataclass
class MeshLayout:
    """What one strategy's layout tells its step (built after the process group exists)."""

    model: torch.nn.Module
    data_rank: int  # which slice of each global batch this rank reads
    data_size: int  # how many slices: the data-parallel degree
    data_groups: list[Any]  # process groups whose ranks read different tokens: counts and losses are summed there
    grad_scale: float  # loss multiplier so the strategy's gradient reduction yields the global mean
    describe: dict[str, Any]  # mesh sizes and strategy facts, logged and saved with checkpoints
    shard_batch: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda batch: batch
    loss_context: Callable[[], ContextManager[Any]] = contextlib.nullcontext
    reduce_grads: Callable[[], None] = lambda: None
    autocast_dtype: torch.dtype | None = None  # training.bf16: forwards under autocast, fp32 weights and optimizer
    callbacks: list[Any] = dataclasses.field(default_factory=list)  # Trainer callbacks the loop adds (its counters)
    # what splits the optimizer's parameter groups besides weight decay (default: the parameter's device mesh); a
    # layout whose meshes change with its degrees names groups that do not, so a resume at other degrees finds the
    # scheduler's per-group state whole
    param_group: Callable[[torch.nn.Parameter], Any] = lambda param: getattr(param, "device_mesh", None)


def check_training_options(cfg: Any, strategy: str) -> None:
    """Refuse TrainingArguments the loop would otherwise ignore (no silent fallbacks).

    An unsupported option that is switched off (False, None, "no") asks for nothing and passes.
    """
    for key, value in cfg.training.items():
        if key not in SUPPORTED_TRAINING and value not in (False, None, "no", "none", "", [], 0):
            raise HftkError(f"training.{key}", f"is not supported with strategy {strategy} (hftk's custom loop).",
                            f"remove it; supported: {', '.join(sorted(SUPPORTED_TRAINING))}.")
        if key in CHOICES and value not in CHOICES[key]:
            raise HftkError(f"training.{key}", f"'{value}' is not supported with strategy {strategy}.",
                            f"use one of: {', '.join(map(str, CHOICES[key]))}.")
    if cfg.tracking.check_sync_steps:
        raise HftkError("tracking.check_sync_steps", f"has no replicas to compare under strategy {strategy}: a "
                        "parameter's digest is taken from its gathered value, the same on every rank.",
                        "remove it (it checks ddp, ZeRO and pipeline replicas).")
    report_to = cfg.training.get("report_to") or []
    for name in [report_to] if isinstance(report_to, str) else report_to:
        if name not in REPORTERS:
            raise HftkError("training.report_to", f"'{name}' is not supported with strategy {strategy}.",
                            f"use {' or '.join(REPORTERS)} (metrics.jsonl is always written).")


def device_type(cfg: Any) -> str:
    """Where the ranks compute: the GPU when there is one (unless ``training.use_cpu``), else the CPU."""
    return "cuda" if torch.cuda.is_available() and not cfg.training.get("use_cpu") else "cpu"


def all_reduce_sum(value: torch.Tensor, groups: list[Any]) -> torch.Tensor:
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(value, group=group)
    return value


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (replicated scalars, gathered shards); a plain tensor as is."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


def model_batch(rows: dict[str, torch.Tensor], device: Any) -> dict[str, torch.Tensor]:
    """Model inputs plus ``shift_labels`` (the next token per position; -100 where none) from the collator's
    rows at ``block_size`` (every rank and shard sees the same shape). Position ids are the collator's under
    packing bfd (restarting per example, no attention mask: the model masks across examples from them),
    else 0.. along each row."""
    input_ids = rows["input_ids"].to(device)
    positions = rows.get("position_ids")
    batch = {
        "input_ids": input_ids,
        "position_ids": (torch.arange(input_ids.shape[1]).expand_as(input_ids) if positions is None
                         else positions).to(device),
        "shift_labels": F.pad(rows["labels"][:, 1:], (0, 1), value=IGNORE_INDEX).to(device),
    }
    if "attention_mask" in rows:
        batch["attention_mask"] = rows["attention_mask"].to(device)
    return batch


def token_count(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["shift_labels"] != IGNORE_INDEX).sum().to(torch.float64)


def loss_terms(model: torch.nn.Module, batch: dict[str, torch.Tensor], autocast_dtype: torch.dtype | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(sum of next-token cross-entropy over this rank's target tokens (logits may be vocabulary-sharded), the
    model's weighted balancing loss when it has experts and trains: ``router_aux_loss_coef x aux_loss`` as
    :mod:`hftk.models.moe` set them, else None).

    ``autocast_dtype``: the forward runs under autocast to it (the Trainer's ``--bf16``); the
    loss is computed in fp32 either way.
    """
    inputs = {k: v for k, v in batch.items() if k != "shift_labels"}
    device = batch["input_ids"].device.type
    with torch.autocast(device, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        out = model(**inputs, use_cache=False)
    ce = F.cross_entropy(out.logits.flatten(0, 1).float(), batch["shift_labels"].flatten(), reduction="sum",
                         ignore_index=IGNORE_INDEX)
    aux = getattr(out, "aux_loss", None)
    return ce, (model.router_aux_loss_coef * aux.float() if isinstance(aux, torch.Tensor) else None)


def loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor], autocast_dtype: torch.dtype | None = None
             ) -> torch.Tensor:
    """:func:`loss_terms`' cross-entropy sum alone (evaluation, the tests' references)."""
    return loss_terms(model, batch, autocast_dtype)[0]


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


@dataclass
class MeshStep:
    """A mesh layout as the custom loop drives it (:mod:`hftk.engine.loop`'s step protocol)."""

    layout: MeshLayout
    device: torch.device

    @property
    def module(self) -> torch.nn.Module:
        return self.layout.model

    monitored = module  # the rank monitor's hooks time this model's forward-to-last-gradient
    config = property(lambda self: self.layout.model.config)
    dp_size = property(lambda self: self.layout.data_size)
    dp_rank = property(lambda self: self.layout.data_rank)
    describe = property(lambda self: self.layout.describe)
    replica_key = None  # never read: check_training_options refuses tracking.check_sync_steps
    callbacks = property(lambda self: self.layout.callbacks)

    @property
    def params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self.layout.model.named_parameters())

    def param_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """The Trainer's decay groups, split by device mesh (the layout's ``param_group``): parameters on different
        meshes (tensor-parallel shards next to replicated norms) cannot share one foreach kernel call."""
        from transformers import Trainer

        decay_names = set(Trainer.get_decay_parameter_names(None, self.layout.model))  # uses no Trainer state
        groups: dict[tuple[bool, Any], list[torch.nn.Parameter]] = {}
        for name, param in self.params:
            if param.requires_grad:
                groups.setdefault((name in decay_names, self.layout.param_group(param)), []).append(param)
        return [{"params": params, "weight_decay": weight_decay if decays else 0.0}
                for (decays, _), params in groups.items()]

    def forward_backward(self, windows: list[dict[str, torch.Tensor]]) -> float:
        """Every micro-batch of one optimizer step, gradients reduced; returns the global mean token loss."""
        layout, model = self.layout, self.layout.model
        model.train()  # from_pretrained returns eval mode; Ulysses and dropout must see training mode
        local = [layout.shard_batch(model_batch(rows, self.device)) for rows in windows]
        tokens = all_reduce_sum(sum(token_count(b) for b in local), layout.data_groups)
        total = torch.zeros((), dtype=torch.float64, device=tokens.device)
        balance = torch.zeros((), dtype=torch.float64, device=tokens.device)
        for i, batch in enumerate(local):
            set_gradient_sync(model, i == len(local) - 1)
            with layout.loss_context():
                summed, aux = loss_terms(model, batch, layout.autocast_dtype)
                objective = [summed * (layout.grad_scale / tokens.item())]
                if aux is not None:  # already divided by the step's micro-batches (hftk.models.moe.prepare)
                    objective.append(aux * layout.grad_scale)  # its own root: the cross-entropy may be a DTensor
                    balance += plain(aux.detach()).to(torch.float64)
                torch.autograd.backward(objective)
            total += plain(summed.detach()).to(torch.float64)
        layout.reduce_grads()
        return float((all_reduce_sum(total, layout.data_groups) / tokens
                      + all_reduce_sum(balance, layout.data_groups)))

    def adapter_tensors(self, names: set[str]) -> dict[str, torch.Tensor]:
        """Collective (every rank, the same order): the LoRA weights ``names`` whole, as CPU tensors."""
        return {n: plain(p.detach()).to("cpu", copy=True) for n, p in self.params if n in names}

    def clip_gradients(self, max_norm: float) -> float:
        return clip_grad_norm(self.layout.model, max_norm)

    @torch.no_grad()
    def eval_sums(self, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """(summed token loss, token count) of one eval batch over the whole data-parallel world."""
        model = self.layout.model
        model.eval()  # forward_backward puts it back in train mode
        batch = self.layout.shard_batch(model_batch(rows, self.device))
        with self.layout.loss_context():
            total = plain(loss_sum(model, batch, self.layout.autocast_dtype)).to(torch.float64)
        return all_reduce_sum(torch.stack([total, token_count(batch)]), self.layout.data_groups)

    def save(self, folder: Path, optimizer: Any) -> None:
        from hftk.strategies.mesh_checkpoint import write_state

        write_state(folder, self.layout, optimizer)

    def load(self, folder: Path, optimizer: Any) -> None:
        from hftk.strategies.mesh_checkpoint import read_state

        read_state(folder, self.layout, optimizer)

    def save_final(self, folder: Path, tokenizer: Any) -> None:
        from hftk.strategies.mesh_checkpoint import save_hf_folder

        save_hf_folder(folder, self.layout, tokenizer)

    def consolidated_model(self, adapter: Any = None) -> torch.nn.Module | None:
        """Collective: every shard gathered to rank 0, which gets a one-process HF model of the current weights
        (in host memory: the engine places it; the other ranks get None). Generation samples run on it: a tensor-,
        context-, sequence- or expert-parallel forward needs every rank in each step, not ``generate``'s loop on
        one. ``adapter``: the run's PEFT config (LoRA, which of these strategies only ep trains): the copy is
        the base with that adapter."""
        from hftk.strategies.mesh_checkpoint import gathered_model

        return gathered_model(self.layout, adapter)


def mesh_step(model: torch.nn.Module, cfg: Any, args: Any, build_layout: Callable[..., MeshLayout]) -> MeshStep:
    """Shard ``model`` with the strategy's ``build_layout`` and wrap it for the loop (bf16 as autocast)."""
    kind = device_type(cfg)
    device = torch.device("cpu") if kind == "cpu" else torch.device("cuda", torch.cuda.current_device())
    layout = build_layout(model.to(device), cfg, kind)
    layout = dataclasses.replace(layout, autocast_dtype=torch.bfloat16 if args.bf16 else None,
                                 describe={**layout.describe, "bf16": bool(args.bf16),
                                           "activation_checkpointing": model.is_activation_checkpointing})
    own_storage(layout.model)
    return MeshStep(layout, device)
