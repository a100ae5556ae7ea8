"""The world-size guard: a run asked to be distributed that is not must stop at once.

On CPU, accelerate and the Trainer silently train each rank alone when ``use_cpu`` or the
launcher flags are missing (see the field notes). We compare three views of the world.

One launch leaves no trace in the environment: ``accelerate launch --num_processes 2`` with no
config file (or with ``--cpu``, or a ``MULTI_CPU`` config and no mpirun) on a machine without
GPUs runs accelerate's simple launcher, which starts the script once, without ``WORLD_SIZE``
(it sets ``MASTER_ADDR`` / ``MASTER_PORT``, but those may as well be the user's own). The
request is still in the launcher's command line: accelerate is this process's parent, and
:func:`check_accelerate_launch` reads its arguments with accelerate's own parser.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
from transformers import TrainerCallback

from hftk.core.errors import HftkError


def launch_fix(processes: int | str = "N") -> str:
    """The launches that do start ``processes`` ranks, on GPUs and CPU-only machines alike."""
    return (f"launch with `accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes {processes} "
            f"scripts/finetune.py` or `torchrun --nproc_per_node {processes} scripts/finetune.py`; on CPU never use "
            "`accelerate launch --cpu`.")


def check_world(training_world_size: int) -> None:
    """Launcher's WORLD_SIZE == process group's == what the Trainer will use."""
    expected = int(os.environ.get("WORLD_SIZE", "1"))
    group = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if expected > 1 and (group != expected or training_world_size != expected):
        raise HftkError(
            "launch", f"WORLD_SIZE={expected} but the process group has {group} rank(s) and the Trainer sees "
            f"{training_world_size}: every rank would train alone on the full data.", launch_fix(expected),
        )


def check_accelerate_launch(env: dict[str, str], launcher_argv: list[str]) -> None:
    """Refuse a run that ``accelerate launch`` (``launcher_argv``, the parent's command line) was asked to start
    in several processes but started alone; before any process group, with the command that starts them here."""
    if "WORLD_SIZE" in env:
        return  # torchrun underneath: check_world compares the rest
    launch_args = accelerate_launch_args(launcher_argv)
    asked = requested_processes(launch_args) if launch_args is not None else 1
    if asked > 1:
        raise HftkError(
            "launch", f"`accelerate launch` was asked for {asked} processes but started this one alone (its simple "
            "launcher: no config file, --cpu or MULTI_CPU on a machine without GPUs); it would train alone on the "
            "full data.", launch_fix(asked))


def parent_argv() -> list[str]:
    """The command line of the process that started this one (Linux ``/proc``; empty where there is none)."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return [arg.decode(errors="replace") for arg in raw.split(b"\0") if arg]


def accelerate_launch_args(argv: list[str]) -> list[str] | None:
    """What follows ``accelerate launch`` (or ``accelerate-launch``, ``-m accelerate.commands.launch``) in
    ``argv``; None when ``argv`` is no accelerate launch."""
    for i, arg in enumerate(argv):
        name = Path(arg).name
        if name == "accelerate" and argv[i + 1:i + 2] == ["launch"]:
            return argv[i + 2:]
        if name == "accelerate-launch" or arg == "accelerate.commands.launch":
            return argv[i + 1:]
    return None


def requested_processes(launch_args: list[str]) -> int:
    """Processes an accelerate launch asked for: ``--num_processes`` (or its config file's), at least
    ``--num_machines``; parsed by accelerate's own parser."""
    from accelerate.commands.config.config_args import default_config_file, load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    args, _ = launch_command_parser().parse_known_args(launch_args)
    counts = [args.num_processes, args.num_machines]
    config_file = args.config_file or (default_config_file if os.path.isfile(default_config_file) else None)
    if config_file and os.path.isfile(config_file) and None in counts:
        config = load_config_from_file(config_file)
        counts = [c if c is not None else getattr(config, name, None)
                  for c, name in zip(counts, ("num_processes", "num_machines"))]
    return max(int(c) for c in counts if c is not None) if any(c is not None for c in counts) else 1


class WorldGuard(TrainerCallback):
    """Re-checks the world and runs the strategy's ``verify`` once the Trainer has wrapped the model."""

    def __init__(self, verify: Callable[[Any], None], trainer: Any) -> None:
        self.verify = verify
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        check_world(args.world_size)
        self.verify(self.trainer)
