"""What a mesh strategy (``tp``, ``cp``, ``sp``) hands the mesh loop, and the loop's option checks.

The strategies build a :class:`MeshLayout` and check options before launch without importing
the engine (:mod:`hftk.engine.mesh_loop`), which loads the strategies.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

from hftk.errors import HftkError

# TrainingArguments fields the loop honours; anything else set explicitly is refused before launch.
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


@dataclass
class MeshLayout:
    """What one strategy's layout tells the loop (built after the process group exists)."""

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


def check_training_options(cfg: Any, strategy: str) -> None:
    """Refuse TrainingArguments the loop would otherwise ignore (no silent fallbacks).

    An unsupported option that is switched off (False, None, "no") asks for nothing and passes.
    """
    for key, value in cfg.training.items():
        if key not in SUPPORTED_TRAINING and value not in (False, None, "no", "none", "", [], 0):
            raise HftkError(f"training.{key}", f"is not supported with strategy {strategy} (hftk's mesh loop).",
                            f"remove it; supported: {', '.join(sorted(SUPPORTED_TRAINING))}.")
        if key in CHOICES and value not in CHOICES[key]:
            raise HftkError(f"training.{key}", f"'{value}' is not supported with strategy {strategy}.",
                            f"use one of: {', '.join(map(str, CHOICES[key]))}.")
    report_to = cfg.training.get("report_to") or []
    for name in [report_to] if isinstance(report_to, str) else report_to:
        if name not in REPORTERS:
            raise HftkError("training.report_to", f"'{name}' is not supported with strategy {strategy}.",
                            f"use {' or '.join(REPORTERS)} (metrics.jsonl is always written).")


def device_type(cfg: Any) -> str:
    """Where the ranks compute: the GPU when there is one (unless ``training.use_cpu``), else the CPU."""
    return "cuda" if torch.cuda.is_available() and not cfg.training.get("use_cpu") else "cpu"
