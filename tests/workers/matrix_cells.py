"""Several runs in one launch (one process group, or one process): ``matrix_cells.py SPEC.json``.

``SPEC.json`` holds ``{"cells": [{"name": ..., "argv": [...]}, ...], "out": DIR}``. Each cell goes
through ``hftk.run.prepare`` and its strategy's engine (``run``: train, save ``final/``, leave the
process group up), as ``hftk train`` does; sharing the launch saves torch's imports and the group's
start-up for every extra cell. accelerate's singletons are cleared between cells (the Trainer's own
hyper-parameter search does the same), transformers' ZeRO-3 marker is dropped, and the environment is put back as the launch set it
(accelerate marks a DeepSpeed run in ``ACCELERATE_USE_DEEPSPEED``, which hftk would read as the next
cell's launcher asking for DeepSpeed), so each cell builds its accelerator, DeepSpeed plugin
included, from its own config. Rank 0 appends one JSON line per finished cell to ``DIR/cells.jsonl``;
a crash stops the launch with the cell's name on stderr.

Optional per spec / cell, for tests that read a run's own output or continue an earlier cell:
``"capture": true`` sends each cell's stdout and stderr (file descriptors, so C++ and logging output
too) to ``DIR/logs/NAME.rankR.log``; a cell's ``"copy": [SRC, DST]`` copies a folder (rank 0) before
the cell starts, e.g. an earlier cell's checkpoint into a resuming cell's output folder; ``"env"``
adds variables for the cell alone (e.g. what ``accelerate launch`` of a strategy's YAML sets);
``"memory_out": FILE`` trains with ``hftk bench memory``'s probe and writes its record there instead.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch.distributed as dist


def run_cell(argv: list[str], env: dict[str, str] | None = None, memory_out: str | None = None) -> None:
    from accelerate.state import AcceleratorState, GradientState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from hftk import strategies
    from hftk.run import prepare

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    unset_hf_deepspeed_config()  # the last ZeRO-3 cell's config would make every from_config partition
    launch_env = dict(os.environ)
    os.environ.update(env or {})
    try:
        prepared = prepare(argv)
        if memory_out:  # what `hftk bench memory` measures, without its teardown
            from hftk.bench.memory_worker import measure
            from hftk.engine.trainer import build_trainer

            measure(build_trainer(prepared)[0], prepared.cfg.strategy.strategy, Path(memory_out))
            return
        engine = strategies.spec(prepared.cfg.strategy.strategy).engine
        importlib.import_module(f"hftk.engine.{engine}").run(prepared)
    finally:
        os.environ.clear()
        os.environ.update(launch_env)


@contextmanager
def captured(path: Path) -> Iterator[None]:
    """Point file descriptors 1 and 2 at ``path`` (append) while the block runs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with path.open("ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)


def barrier() -> None:
    if dist.is_initialized():  # a one-process launch has no group
        dist.barrier()


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    log = out / "cells.jsonl"
    rank = int(os.environ.get("RANK", "0"))
    for cell in spec["cells"]:
        start = time.perf_counter()
        if "copy" in cell:
            if rank == 0:
                shutil.copytree(*cell["copy"])
            barrier()
        capture = captured(out / "logs" / f"{cell['name']}.rank{rank}.log") if spec.get("capture") else nullcontext()
        try:
            with capture:
                run_cell(cell["argv"], cell.get("env"), cell.get("memory_out"))
        except BaseException:
            print(f"matrix cell {cell['name']} crashed", file=sys.stderr, flush=True)
            raise
        barrier()
        if rank == 0:
            with log.open("a") as f:
                f.write(json.dumps({"name": cell["name"], "wall_s": round(time.perf_counter() - start, 2)}) + "\n")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from hftk.run import exit_without_teardown

    exit_without_teardown(main(sys.argv[1]))  # skips gloo's teardown abort
