"""Fault injection for the resilience and Hub tests: runs that get killed, and the shared reference run.

A run is started in its own session under torchrun; :func:`wait_for_step` follows its
``metrics.jsonl``; :func:`worker_pid` finds one rank's process through its environment (each
launch carries a unique ``HFTK_TEST_LAUNCH`` tag), the way an OOM killer or a scheduler would
pick a victim from outside. Everything is bounded by timeouts and killed as a process group.

The uninterrupted reference run is shared by ``tests/integration/test_resilience.py`` and ``test_hub.py`` (one
launch per pytest process): it also pushes to the local Hub server, whose first commits fail.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import FINETUNE, ROOT, TINY_ARGS, Launch, free_port, require_ranks, torchrun_command
from tests.hub_server import HubServer

TOKEN = "hf_hftkTEST" + "x9Q2" * 6  # what the runs authenticate with; must never appear in any output
REPO = "hftk-test/tiny-ddp"
STEPS = 30
SAVE_STEPS = 5
# 200 raw rows make 11 optimizer steps per epoch at global batch 8: 30 steps cross two epoch boundaries.
# Every random kill step is drawn from this seed (printed at the end of pytest's output and in each fault's
# failure message); HFTK_FAULT_SEED=<seed> replays the same steps.
FAULT_SEED = int(os.environ.get("HFTK_FAULT_SEED") or random.SystemRandom().randrange(2**32))
DRAWN: list[str] = []  # "<fault> at step N", for the session's summary (tests/conftest.py)
RUN_ARGS = [*TINY_ARGS, "--max_train_samples", "200", "--max_steps", str(STEPS), "--per_device_train_batch_size", "4",
            "--save_strategy", "steps", "--save_steps", str(SAVE_STEPS), "--save_total_limit", "0"]


@dataclass
class Running:
    proc: subprocess.Popen
    tag: str
    output_dir: Path
    started: float
    logs: tuple[Path, Path]  # stdout, stderr: files, because a pipe nobody drains blocks the ranks once full

    def kill(self) -> None:
        """SIGKILL the launcher and every rank (one process group)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def output(self) -> tuple[str, str]:
        return self.logs[0].read_text(errors="replace"), self.logs[1].read_text(errors="replace")

    def finish(self, timeout: float) -> Launch:
        """Wait for the launch; kill its whole process group and fail when it overruns."""
        try:
            self.proc.wait(timeout=max(1.0, timeout - (time.time() - self.started)))
        except subprocess.TimeoutExpired:
            self.kill()
            out, err = self.output()
            raise AssertionError(f"timed out after {timeout}s\n{out[-3000:]}\n{err[-5000:]}")
        return Launch(self.proc.returncode, *self.output())


def side_by_side(cmds: dict[str, list[str]], env: dict[str, dict[str, str]], logs: Path,
                 timeout: float) -> dict[str, tuple[int, str]]:
    """Run several commands at once (each in its own session, output in ``logs/<name>.log``): name -> (rc, output)."""
    procs = {}
    for name, cmd in cmds.items():  # files, not pipes: an undrained pipe blocks its writer once full
        with open(logs / f"{name}.log", "w") as log:
            procs[name] = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **env[name]},
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    results = {}
    for name, proc in procs.items():
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs.values():
                if other.poll() is None:
                    os.killpg(other.pid, signal.SIGKILL)
            raise AssertionError(f"{name} timed out after {timeout}s") from None
        results[name] = (proc.returncode, (logs / f"{name}.log").read_text(errors="replace"))
    return results


def hub_env(hub: HubServer) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.base_url, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_XET": "1", "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_TELEMETRY": "1"}


def start(nproc: int, args: list[str], output_dir: Path, max_restarts: int = 0, script: Path = FINETUNE,
          env: dict[str, str] | None = None) -> Running:
    """torchrun ``script`` with ``args`` in a new session (not waited for)."""
    require_ranks(nproc)
    tag = uuid.uuid4().hex
    # Restarts need a fresh store per round (hftk refuses anything else): the c10d rendezvous
    # with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.
    rendezvous = ([f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
                   f"--rdzv-id={tag}"] if max_restarts else ["--master_addr=127.0.0.1", f"--master_port={free_port()}"])
    env = {**(env or {}), **({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if max_restarts else {})}
    cmd = torchrun_command(nproc, str(script), *args, "--output_dir", str(output_dir), rendezvous=rendezvous)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HFTK_TEST_LAUNCH": tag,
                **env}
    logs = (output_dir.parent / f"{output_dir.name}.stdout", output_dir.parent / f"{output_dir.name}.stderr")
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(logs[0], "w") as out, open(logs[1], "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=full_env, cwd=ROOT, start_new_session=True)
    return Running(proc, tag, output_dir, time.time(), logs)


def logged_steps(output_dir: Path) -> list[int]:
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line being written
        if "loss" in record:
            steps.append(record["step"])
    return steps


def fault_step(name: str, low: int, high: int) -> tuple[int, str]:
    """The step in [low, high] at which fault ``name`` strikes, and the line that replays it. Each fault
    draws from its own generator (seeded by :data:`FAULT_SEED` and ``name``), so one test run alone
    (``-k``) gets the same step as in the full suite. The step is the one asked for; the kill lands at
    the first step logged from then on (timing decides which)."""
    step = random.Random(f"{FAULT_SEED}/{name}").randint(low, high)
    replay = f"{name} at step {step} (replay: HFTK_FAULT_SEED={FAULT_SEED})"
    DRAWN.append(f"{name} at step {step}")
    print(f"hftk-test: fault {replay}", flush=True)
    return step, replay


def wait_for_step(run: Running, step: int, timeout: float) -> int:
    """Block until the run has logged a loss at ``step`` or later; returns the newest logged step."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        steps = logged_steps(run.output_dir)
        if steps and max(steps) >= step:
            return max(steps)
        if run.proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {run.proc.returncode}) before step {step}:\n"
                                 f"{run.output()[1][-5000:]}")
        time.sleep(0.01)
    run.kill()
    raise AssertionError(f"step {step} not reached within {timeout}s (steps logged: {logged_steps(run.output_dir)})")


def worker_pid(run: Running, rank: int, restart: int = 0, timeout: float = 60) -> int:
    """The process of ``rank`` in restart round ``restart`` of this launch (found through /proc)."""
    wanted = {b"HFTK_TEST_LAUNCH=" + run.tag.encode(), b"RANK=%d" % rank, b"TORCHELASTIC_RESTART_COUNT=%d" % restart}
    deadline = time.time() + timeout
    while time.time() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                env = set((entry / "environ").read_bytes().split(b"\0"))
            except OSError:
                continue
            if wanted <= env:
                return int(entry.name)
        time.sleep(0.05)
    raise AssertionError(f"no rank {rank} worker of restart {restart} found")


@functools.cache
def hub_server() -> HubServer:
    """One local Hub for the whole pytest process; its first two commits and first LFS upload fail."""
    server = HubServer(token=TOKEN).__enter__()
    server.fail("commit", 2)
    server.fail("lfs-upload", 1, status=503)
    return server


@functools.cache
def reference_run(base: Path) -> tuple[Path, Launch]:
    """The uninterrupted 2-rank DDP run every fault is compared with; it pushes each save to the Hub. A real
    launch, like the faulted runs: test_the_previous_checkpoint_was_left_intact compares their RNG files
    byte for byte, and a warm rank's Python RNG state at checkpoint-5 differed from a launched one's."""
    out = base / "reference"
    hub = hub_server()
    args = [*RUN_ARGS, "--push_to_hub", "--hub_model_id", REPO, "--hub_strategy", "checkpoint",
            "--hub_retry_backoff_s", "0.2"]
    result = start(2, args, out, env=hub_env(hub)).finish(timeout=400)
    assert result.returncode == 0, f"reference run failed ({result.returncode}):\n{result.output[-6000:]}"
    return out, result
