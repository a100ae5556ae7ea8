"""Turning ``strategy.grad_compression`` / ``hierarchical_allreduce`` into a hook on a DDP model.

:func:`validate` runs before any process group exists; :func:`register_compression` works on
any ``DistributedDataParallel`` (the Trainer's, an Accelerate loop's, a pipeline's data-parallel
replicas); :func:`save_state` / :func:`load_state` carry error feedback and PowerSGD factors
through checkpoints, one file per rank (each rank's error is its own).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from hftk.comm.accounting import CommStats
from hftk.comm.collectives import FlatComm
from hftk.comm.hierarchical import HierarchicalComm, discover_topology
from hftk.comm.hooks import HookState, average, cast_average, timed, topk_average
from hftk.comm.powersgd import powersgd_average
from hftk.config.options import StrategyConfig
from hftk.config.strategy_table import STRATEGIES
from hftk.core.errors import HftkError

HOOKS: dict[str, Callable[[HookState, Any], torch.futures.Future]] = {
    "allreduce": timed(average),
    "fp16": timed(cast_average(torch.float16)),
    "bf16": timed(cast_average(torch.bfloat16)),
    "powersgd": timed(powersgd_average),
    "topk": timed(topk_average),
}
STATE_DIR = "hftk_comm"
# hook -> (option, lowest valid value, an example) for its integer options
INTEGER_OPTIONS = {
    "powersgd": (("powersgd_rank", 1, 4), ("powersgd_warmup_steps", 0, 10)),
    "topk": (("topk_warmup_steps", 0, 10),),
}


def is_active(cfg: StrategyConfig) -> bool:
    return cfg.grad_compression != "none" or cfg.hierarchical_allreduce


def validate(cfg: StrategyConfig, world_size: int, env: dict[str, str]) -> None:
    """One-line errors for compression options that cannot work, before any process group."""
    if not is_active(cfg):
        return
    option = "strategy.grad_compression" if cfg.grad_compression != "none" else "strategy.hierarchical_allreduce"
    if not (cfg.strategy in STRATEGIES and STRATEGIES[cfg.strategy].grad_compression):
        able = " or ".join(n for n, spec in STRATEGIES.items() if spec.grad_compression)
        raise HftkError(option, f"hooks into DDP's gradient all-reduce; strategy '{cfg.strategy}' has none.",
                        f"use --strategy {able}, or drop the compression options.")
    for name, low, example in INTEGER_OPTIONS.get(cfg.grad_compression, ()):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < low:
            raise HftkError(f"strategy.{name}", f"must be an integer >= {low}, got {value!r}.", f"use e.g. {example}.")
    ratio = cfg.topk_ratio
    if cfg.grad_compression == "topk" and not (isinstance(ratio, float) and 0 < ratio < 1 and math.isfinite(ratio)):
        raise HftkError("strategy.topk_ratio", f"must be in (0, 1), got {ratio!r}.", "use e.g. 0.01 (1% of the entries).")
    if world_size < 2:
        raise HftkError(option, "needs at least two processes (there is no all-reduce to shrink in one).",
                        "launch with torchrun / accelerate launch --num_processes 2 or more.")
    if cfg.hierarchical_allreduce and not {"GROUP_RANK", "LOCAL_WORLD_SIZE"} <= set(env):
        raise HftkError("strategy.hierarchical_allreduce", "needs GROUP_RANK and LOCAL_WORLD_SIZE to find the nodes.",
                        "launch with torchrun or accelerate launch (they set both).")


def register_compression(ddp_model: Any, cfg: StrategyConfig, process_group: Any = None) -> HookState:
    """Register hftk's hook for ``cfg`` on ``ddp_model``; returns its state (counters, error feedback).

    Call it on every rank, after DDP wrapped the model and before the first backward. With
    ``grad_compression`` none it registers the plain all-reduce (for the byte counters, or to run
    it hierarchically). ``process_group`` restricts a flat hook to a data-parallel subgroup.
    """
    stats = CommStats(world_size=dist.get_world_size(process_group),
                      arrival_timed=dist.get_backend(process_group) == "gloo")
    if cfg.hierarchical_allreduce:
        if process_group is not None:
            raise ValueError("hierarchical all-reduce spans the whole world; it takes no process_group")
        comm: Any = HierarchicalComm(stats, discover_topology())
    else:
        comm = FlatComm(stats, process_group)
    kind = "allreduce" if cfg.grad_compression == "none" else cfg.grad_compression
    state = HookState(kind=kind, comm=comm, stats=stats,
                      names={id(p): n for n, p in ddp_model.module.named_parameters()},
                      powersgd_rank=cfg.powersgd_rank, powersgd_warmup_steps=cfg.powersgd_warmup_steps,
                      topk_ratio=cfg.topk_ratio, topk_warmup_steps=cfg.topk_warmup_steps)
    ddp_model.register_comm_hook(state, HOOKS[kind])
    return state


def state_dict(state: HookState) -> dict[str, Any]:
    """Tensors and plain values only, so ``torch.load(weights_only=True)`` reads it back."""
    return {
        "kind": state.kind,
        "step": state.step,
        "error": {name: t.detach().to("cpu", copy=True) for name, t in state.error.items()},
        "q": {name: t.detach().to("cpu", copy=True) for name, t in state.q.items()},
    }


def load_state_dict(state: HookState, saved: dict[str, Any], device: torch.device) -> None:
    if saved["kind"] != state.kind:
        raise HftkError("strategy.grad_compression", f"the checkpoint was trained with '{saved['kind']}', "
                        f"this run uses '{state.kind}'.", f"resume with --grad_compression {saved['kind']}.")
    state.step = int(saved["step"])
    state.error = {name: t.to(device) for name, t in saved["error"].items()}
    state.q = {name: t.to(device) for name, t in saved["q"].items()}


def state_path(checkpoint_dir: Path, rank: int) -> Path:
    return Path(checkpoint_dir) / STATE_DIR / f"rank{rank}.pt"


def save_state(state: HookState, checkpoint_dir: Path, rank: int) -> Path:
    path = state_path(checkpoint_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state_dict(state), tmp)
    tmp.replace(path)
    return path


def load_state(state: HookState, checkpoint_dir: Path, rank: int, device: torch.device) -> None:
    path = state_path(checkpoint_dir, rank)
    if not path.is_file():
        raise HftkError("training.resume_from_checkpoint", f"{checkpoint_dir} has no gradient-compression state "
                        f"for rank {rank} ({STATE_DIR}/rank{rank}.pt): it was saved without --grad_compression "
                        "or with another world size.", "resume with the options and world size it was trained with.")
    load_state_dict(state, torch.load(path, weights_only=True, map_location="cpu"), device)
