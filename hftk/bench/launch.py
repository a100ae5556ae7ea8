"""Launching bench workers: torchrun on loopback, a hard timeout, the machine's load recorded.

Every launch runs in its own session and is killed as a process group when it overruns, so a
hung collective costs one timeout, not the whole bench. Each rank gets ``threads`` intra-op
threads; by default the cores are split evenly among the most processes any bench launches,
so a 1-process and a 2-process run use the same per-rank compute (what scaling compares).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

# Small built-in model and short blocks: a bench that finishes in minutes on a 2-core CPU.
DEFAULT_MODEL = "builtin:gpt2-small"
# hftk train options every bench run shares: no eval, no checkpoints, no trackers, one log per step.
BENCH_TRAIN_ARGS = [
    "--eval_fraction", "0", "--eval_strategy", "no", "--save_strategy", "no", "--report_to", "none",
    "--disable_tqdm", "true", "--logging_steps", "1", "--lr_scheduler_type", "constant", "--warmup_steps", "0",
    "--optim", "adamw_torch_fused",
]


@dataclass
class Machine:
    """What the figures depend on; recorded with every report."""

    device: str
    device_count: int
    cpu_count: int
    torch: str
    loadavg_start: list[float] = field(default_factory=lambda: list(os.getloadavg()))

    @classmethod
    def here(cls) -> Machine:
        return cls(device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                   device_count=torch.cuda.device_count(), cpu_count=os.cpu_count() or 1, torch=torch.__version__)


def max_processes() -> int:
    """One process per GPU; on CPU one per core."""
    return torch.cuda.device_count() if torch.cuda.is_available() else (os.cpu_count() or 1)


def threads_per_rank(most_processes: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, most_processes))


# A command that starts a bench's ranks in place of ``python -m torch.distributed.run``, with its options (a
# site's wrapper; the test suite's warm ranks, tests/warm_torchrun.py). The startup bench keeps torchrun: its
# subject is the launcher's own start-up.
LAUNCHER_ENV = "HFTK_BENCH_LAUNCHER"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int, *target: str, nnodes: int = 1, rendezvous: list[str] | None = None) -> list[str]:
    """``python -m torch.distributed.run`` for ``target`` (launcher options, then a script or ``-m MODULE``,
    then its arguments): static rendezvous on loopback at a free port unless ``rendezvous`` names
    another (c10d with restarts, another host). The one torchrun command of the benches and the tests."""
    where = ["--master_addr=127.0.0.1", f"--master_port={free_port()}"] if rendezvous is None else rendezvous
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--nnodes={nnodes}", *where,
            *target]


@dataclass
class LaunchResult:
    ranks: list[dict[str, Any]]
    wall_s: float
    loadavg_before: list[float]
    loadavg_after: list[float]


def bench_command(nproc: int, *target: str, real_torchrun: bool = False) -> list[str]:
    """The command of one bench launch: ``$HFTK_BENCH_LAUNCHER --nproc_per_node=N --nnodes=1 TARGET`` where that is
    set (and ``real_torchrun`` is not), else :func:`torchrun_command`."""
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher is None or real_torchrun:
        return torchrun_command(nproc, *target)
    return [*shlex.split(launcher), f"--nproc_per_node={nproc}", "--nnodes=1", *target]


def torchrun_module(nproc: int, module: str, args: list[str], work_dir: Path, timeout: float, threads: int,
                    env: dict[str, str] | None = None, done: Callable[[], bool] | None = None,
                    real_torchrun: bool = False) -> LaunchResult:
    """``python -m torch.distributed.run ... -m MODULE ARGS`` (``module`` a ``.py`` path: that script) on loopback
    (or :data:`LAUNCHER_ENV`'s command unless ``real_torchrun``),
    logged to ``work_dir/log.txt``: its wall time and the load average around it (no ranks). Raises RuntimeError with the log's tail on failure or
    after ``timeout``. ``done`` says whether every rank has written its results: a launch that then fails to
    exit (a hung teardown) is killed after a grace period instead of costing the whole timeout."""
    work_dir.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1", **(env or {})}
    log_path = work_dir / "log.txt"
    before, start = list(os.getloadavg()), time.perf_counter()
    with open(log_path, "w") as log:
        target = [module] if module.endswith(".py") else ["-m", module]
        proc = subprocess.Popen(bench_command(nproc, *target, *args, real_torchrun=real_torchrun), stdout=log,
                                stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        code = _wait(proc, timeout, done)
    if code is None:
        raise RuntimeError(f"bench launch timed out after {timeout:.0f}s ({work_dir}):\n{_tail(log_path)}")
    if code == HUNG_AFTER_RESULTS:
        print(f"hftk bench: every rank wrote its results but the launch did not exit within {EXIT_GRACE_S}s "
              f"(process-group teardown); killed it ({work_dir})", flush=True)
    elif code != 0 and done is not None and done():
        print(f"hftk bench: every rank wrote its results, then the launch exited with code {code} at teardown; "
              f"results kept ({work_dir}/log.txt)", flush=True)
    elif code != 0:
        raise RuntimeError(f"bench launch failed with exit code {code} ({work_dir}):\n{_tail(log_path)}")
    return LaunchResult([], time.perf_counter() - start, before, list(os.getloadavg()))


HUNG_AFTER_RESULTS = -999
EXIT_GRACE_S = 60


def _wait(proc: subprocess.Popen, timeout: float, done: Callable[[], bool] | None) -> int | None:
    """The exit code; None after ``timeout``; HUNG_AFTER_RESULTS when ``done()`` held for EXIT_GRACE_S
    but the processes did not exit. Overrunning launches are killed as a process group."""
    deadline, finished_at = time.monotonic() + timeout, None
    while True:
        try:
            return proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            now = time.monotonic()
            if finished_at is None and done is not None and done():
                finished_at = now
            hung = finished_at is not None and now - finished_at > EXIT_GRACE_S
            if now > deadline or hung:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return HUNG_AFTER_RESULTS if hung else None


def run_workers(nproc: int, spec: dict[str, Any], work_dir: Path, timeout: float, threads: int,
                env: dict[str, str] | None = None, module: str = "hftk.bench.worker") -> LaunchResult:
    """Run ``module`` (:mod:`hftk.bench.worker` by default) on ``nproc`` ranks with ``spec`` (as a
    ``spec.json`` path); every rank writes ``rank{R}.json`` into ``spec["out"]``: return them all."""
    spec_path, files = work_dir / "spec.json", [work_dir / "ranks" / f"rank{r}.json" for r in range(nproc)]
    work_dir.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps({**spec, "out": str(work_dir / "ranks")}, indent=1))
    launch = torchrun_module(nproc, module, [str(spec_path)], work_dir, timeout, threads, env,
                             done=lambda: all(f.exists() for f in files))
    launch.ranks = [json.loads(f.read_text()) for f in files]
    return launch


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
