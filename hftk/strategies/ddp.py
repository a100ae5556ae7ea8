"""DDP: every rank holds the whole model; gradients are all-reduced (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hftk.config.options import RunConfig
from hftk.core.errors import HftkError


def validate(cfg: RunConfig, world_size: int) -> None:
    """DDP runs at any world size (1 is plain training); FSDP-only options would be ignored."""
    for name in ("fsdp_cpu_offload", "fsdp_hybrid"):
        if getattr(cfg.strategy, name):
            raise HftkError(f"strategy.{name}", "is an FSDP option; ddp keeps the whole model on every rank and "
                            "would ignore it.", f"use --strategy fsdp --{name}, or drop it.")


def training_arguments(cfg: RunConfig, model_config: Any) -> dict[str, Any]:
    return {}


def prepare_model(model: Any, cfg: RunConfig) -> Any:
    return model


def verify(trainer: Any) -> None:
    """At world size > 1 the Trainer must have wrapped the model in DDP."""
    if dist.is_initialized() and dist.get_world_size() > 1 and not isinstance(trainer.model_wrapped,
                                                                               DistributedDataParallel):
        raise HftkError(
            "strategy.strategy",
            f"ddp was asked for at world size {dist.get_world_size()} but the Trainer wrapped the model as "
            f"{type(trainer.model_wrapped).__name__}, so ranks would train apart.",
            "launch with `accelerate launch --config_file accelerate_configs/ddp.yaml` or torchrun.",
        )


def save_final(trainer: Any, out_dir: Path) -> None:
    """The Trainer's own save of the whole model (rank 0), proven complete like every strategy's."""
    trainer.save_model(str(out_dir))
    if trainer.args.should_save:
        from hftk.checkpoint.hf_folder import check_complete, shapes_of

        check_complete(out_dir, shapes_of(trainer.model))
