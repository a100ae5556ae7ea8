"""The world-size guard: a run asked to be distributed that is not must stop at once.

On CPU, accelerate and the Trainer silently train each rank alone when ``use_cpu`` or the
launcher flags are missing (see the field notes). We compare three views of the world.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch.distributed as dist
from transformers import TrainerCallback

from hftk.errors import HftkError

FIX = ("launch with `accelerate launch --config_file accelerate_configs/ddp.yaml scripts/finetune.py` "
       "or `torchrun --nproc_per_node N scripts/finetune.py`; on CPU never use `accelerate launch --cpu`.")


def check_world(training_world_size: int) -> None:
    """Launcher's WORLD_SIZE == process group's == what the Trainer will use."""
    expected = int(os.environ.get("WORLD_SIZE", "1"))
    group = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if expected > 1 and (group != expected or training_world_size != expected):
        raise HftkError(
            "launch", f"WORLD_SIZE={expected} but the process group has {group} rank(s) and the Trainer sees "
            f"{training_world_size}: every rank would train alone on the full data.", FIX,
        )


class WorldGuard(TrainerCallback):
    """Re-checks the world and runs the strategy's ``verify`` once the Trainer has wrapped the model."""

    def __init__(self, verify: Callable[[Any], None], trainer: Any) -> None:
        self.verify = verify
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        check_world(args.world_size)
        self.verify(self.trainer)
