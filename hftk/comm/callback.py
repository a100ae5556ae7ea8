"""Gradient compression in the HF Trainer path.

transformers 5.24 has no ``ddp_comm_hook`` option, but at ``on_train_begin`` the Trainer's
``model_wrapped`` is already the DDP module and no backward has run: the hook is registered
there. Per-step counters go into every log line (and from there to ``metrics.jsonl``,
tensorboard, wandb); the hook state goes into every checkpoint and comes back on resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from hftk.comm.register import load_state, register_compression, save_state
from hftk.config.options import StrategyConfig
from hftk.core.errors import HftkError


class CompressionCallback(TrainerCallback):
    """Registers hftk's hook on the Trainer's DDP model, logs its counters, checkpoints its state."""

    def __init__(self, trainer: Any, cfg: StrategyConfig, resume_dir: str | None) -> None:
        self.trainer = trainer
        self.cfg = cfg
        self.resume_dir = resume_dir
        self.state: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ddp = self.trainer.model_wrapped
        if not isinstance(ddp, DistributedDataParallel):
            raise HftkError("strategy.grad_compression", f"the Trainer wrapped the model as {type(ddp).__name__}, "
                            "not DistributedDataParallel, so there is no gradient all-reduce to hook.",
                            "launch at least two processes with --strategy ddp.")
        self.state = register_compression(ddp, self.cfg)
        if self.resume_dir:
            load_state(self.state, Path(self.resume_dir), dist.get_rank(), next(ddp.parameters()).device)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.state.stats.end_step()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs is not None and "loss" in logs:
            logs.update(self.state.stats.pop_window())

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Each rank writes its own state once rank 0 has written the checkpoint folder."""
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        dist.barrier()
        save_state(self.state, checkpoint, dist.get_rank())
        dist.barrier()  # the checkpoint is complete for every rank before anyone moves on


class StepCommCallback(TrainerCallback):
    """A strategy's own collectives (expert parallel's all-to-alls), counted by a
    :class:`hftk.comm.accounting.CommStats`: bytes this rank sends and collectives per optimizer step, logged as
    ``{prefix}_bytes_per_step`` and ``{prefix}_per_step``."""

    def __init__(self, stats: Any, prefix: str) -> None:
        self.stats = stats
        self.prefix = prefix

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.stats.end_step()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs is not None and "loss" in logs and (window := self.stats.pop_window()):
            logs[f"{self.prefix}_bytes_per_step"] = window["comm_bytes_per_step"]
            logs[f"{self.prefix}_per_step"] = window["comm_collectives_per_step"]
