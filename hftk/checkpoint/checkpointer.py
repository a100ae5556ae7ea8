"""One checkpointer for the custom loop: the strategy's sharded state plus every stateful object by name.

``checkpoint-N`` holds what the step writes (pipeline stage files, or DCP shards), the files of
each object with ``state_dict`` / ``load_state_dict`` (the LR scheduler as ``scheduler.pt``, the
Trainer's ``trainer_state.json``: a ``.json`` name is written as JSON, anything else through
``torch.save`` and read back with ``weights_only=True``), every rank's RNG generators
(:func:`hftk.checkpoint.atomic.save_rng`), the model config and tokenizer. It is staged, sealed,
renamed and rotated by :func:`hftk.checkpoint.atomic.atomic_save`, like the Trainer's own checkpoints.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from hftk.checkpoint.atomic import atomic_save, save_rng


@dataclass
class TrainerStateFile:
    """transformers' ``TrainerState`` as a stateful object: the fields ``trainer_state.json`` holds."""

    state: Any
    RESUMED = ("global_step", "epoch", "log_history", "total_flos", "best_metric", "best_global_step")

    def state_dict(self) -> dict[str, Any]:
        return asdict(self.state)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        for key in self.RESUMED:
            setattr(self.state, key, saved.get(key))


@dataclass
class Checkpointer:
    output_dir: Path
    step: Any  # the strategy's step: ``save(folder, optimizer)`` / ``load(folder, optimizer)`` of its shards
    optimizer: torch.optim.Optimizer
    objects: dict[str, Any]  # file name -> object with state_dict / load_state_dict (written by rank 0)
    save_total_limit: int | None
    global_batch: int
    config: Any  # the model config, saved beside the shards
    tokenizer: Any
    extra: Callable[[Path], None] = lambda folder: None  # collective: more of this rank's files (a LoRA adapter)

    def _write(self, folder: Path) -> None:
        self.step.save(folder, self.optimizer)
        self.extra(folder)
        save_rng(folder)
        if dist.get_rank() == 0:
            self.config.save_pretrained(folder)
            self.tokenizer.save_pretrained(folder)
            for name, obj in self.objects.items():  # the Trainer's state last: the loader reads it for the step
                if name.endswith(".json"):
                    (folder / name).write_text(json.dumps(obj.state_dict(), indent=2, sort_keys=True) + "\n")
                else:
                    torch.save(obj.state_dict(), folder / name)

    def save(self, global_step: int) -> Path:
        """Collective: ``output_dir/checkpoint-<global_step>``, published whole or not at all."""
        return atomic_save(self.output_dir, global_step, self._write, self.save_total_limit, self.global_batch)

    def load(self, folder: Path) -> None:
        """Restore the step's shards and optimizer, then every object; the RNG is the loop's to restore
        (after the data position is skipped to, as the Trainer does)."""
        folder = Path(folder)
        self.step.load(folder, self.optimizer)
        for name, obj in self.objects.items():
            path = folder / name
            obj.load_state_dict(json.loads(path.read_text()) if name.endswith(".json")
                                else torch.load(path, weights_only=True))
