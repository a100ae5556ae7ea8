"""Several matrix cells in one launch (one process group): ``matrix_cells.py SPEC.json``.

``SPEC.json`` holds ``{"cells": [{"name": ..., "argv": [...]}, ...], "out": DIR}``. Each cell goes
through ``hftk.run.prepare`` and its strategy's engine (``run``: train, save ``final/``, leave the
process group up), as ``hftk train`` does; sharing the launch saves torch's imports and the group's
start-up for every extra cell. accelerate's singletons are cleared between cells (the Trainer's own
hyper-parameter search does the same), transformers' ZeRO-3 marker is dropped, and the environment is put back as the launch set it
(accelerate marks a DeepSpeed run in ``ACCELERATE_USE_DEEPSPEED``, which hftk would read as the next
cell's launcher asking for DeepSpeed), so each cell builds its accelerator, DeepSpeed plugin
included, from its own config. Rank 0 appends one JSON line per finished cell to ``DIR/cells.jsonl``;
a crash stops the launch with the cell's name on stderr.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist


def run_cell(argv: list[str]) -> None:
    from accelerate.state import AcceleratorState, GradientState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from hftk import strategies
    from hftk.run import prepare

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    unset_hf_deepspeed_config()  # the last ZeRO-3 cell's config would make every from_config partition
    launch_env = dict(os.environ)
    try:
        prepared = prepare(argv)
        engine = getattr(strategies.get(prepared.cfg.strategy.strategy), "ENGINE", "trainer")
        importlib.import_module(f"hftk.engine.{engine}").run(prepared)
    finally:
        os.environ.clear()
        os.environ.update(launch_env)


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    log = Path(spec["out"]) / "cells.jsonl"
    for cell in spec["cells"]:
        start = time.perf_counter()
        try:
            run_cell(cell["argv"])
        except BaseException:
            print(f"matrix cell {cell['name']} crashed", file=sys.stderr, flush=True)
            raise
        grouped = dist.is_initialized()  # a one-process launch (world size 1) starts no group
        if grouped:
            dist.barrier()
        if not grouped or dist.get_rank() == 0:
            with log.open("a") as f:
                f.write(json.dumps({"name": cell["name"], "wall_s": round(time.perf_counter() - start, 2)}) + "\n")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from hftk.run import exit_without_teardown

    exit_without_teardown(main(sys.argv[1]))  # skips gloo's teardown abort
