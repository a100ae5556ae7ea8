"""One module per strategy, each the single place that strategy lives.

Every strategy module answers the same questions with plain functions (no base class):

- ``validate(cfg, world_size)``: strategy-specific checks, before any process group.
- ``training_arguments(cfg, model_config) -> dict``: extra ``TrainingArguments`` kwargs
  (a DeepSpeed config, DDP options, ...).
- ``prepare_model(model, cfg) -> model``: parallelism applied from outside the model code
  before the Trainer sees it (identity for DDP and DeepSpeed, which the Trainer wraps).
- ``verify(trainer)``: called at train begin; raise if the run is not really distributed
  the way its name says (the field's silent fallbacks to DDP or to one process).
- ``save_final(trainer, out_dir)``: write a complete, consolidated HF folder.
- optional ``callbacks(trainer) -> list``: Trainer callbacks the strategy needs, run after the
  world guard (DeepSpeed shares ZeRO-3's fp32 master with the parameters at train begin).
- optional ``trainer_factory(cfg) -> callable``: builds the Trainer instead of
  ``transformers.Trainer`` when the strategy owns model/optimizer I/O (FSDP2's DTensor shards).
- optional ``RESHARDS_ON_RESUME = True``: its checkpoints resume at another world size (whole or
  DCP-resharded state; ``validate.check_world_change`` asks for the same global batch). Without it a
  resume at another world size is refused, with ``OTHER_WORLD_SIZE_FIX`` added to the fix when set.
- optional ``data_parallel_size(cfg, world_size) -> int``: how many ranks read different samples
  (default: every rank), which the global batch kept by such a resume is counted over.

A strategy whose layout the HF Trainer cannot drive names its engine module under
``hftk.engine`` in ``ENGINE`` (default ``"trainer"``). Tensor, context and sequence parallel
(``tp``, ``cp``, ``sp``) set ``ENGINE = "mesh_loop"`` and answer ``validate`` plus
``layout(model, cfg, device_type) -> MeshLayout`` (see :mod:`hftk.strategies.mesh`) instead of
the Trainer hooks. Pipeline (``pipeline``) sets ``ENGINE = "loop"`` (:mod:`hftk.engine.loop`:
the Trainer's own state, callbacks, optimizer and scheduler around a pipeline schedule).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from hftk.errors import HftkError

MODULES = {
    "ddp": "hftk.strategies.ddp",
    "fsdp": "hftk.strategies.fsdp",
    "zero1": "hftk.strategies.deepspeed",
    "zero2": "hftk.strategies.deepspeed",
    "zero3": "hftk.strategies.deepspeed",
    "zero3_offload": "hftk.strategies.deepspeed",
    "tp": "hftk.strategies.tensor",
    "cp": "hftk.strategies.tensor",
    "sp": "hftk.strategies.sequence",
    "pipeline": "hftk.strategies.pipeline",
}


def get(name: str) -> ModuleType:
    """The module implementing strategy ``name``."""
    if name not in MODULES:
        raise HftkError("strategy.strategy", f"'{name}' is not implemented yet.",
                        f"use one of: {', '.join(MODULES)}.")
    return importlib.import_module(MODULES[name])
