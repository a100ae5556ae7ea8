"""Two hosts (network namespaces joined by veth when root, else loopback): multi-node runs
equal a single-node run with the same global batch."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import (FINETUNE, TINY_ARGS, finetune, free_port, load_weights, losses, max_weight_diff, metrics,
                           require_ranks, torchrun, torchrun_command)
from tests.netns import run_on_two_hosts, two_hosts

pytestmark = pytest.mark.slow
STEPS = 5
GLOBAL_BATCH = 8


def run_two_nodes(out, nproc: int, args: list[str], timeout: float = 420) -> None:
    """One torchrun per host, both writing to one output dir (a shared file system)."""
    per_rank = GLOBAL_BATCH // (2 * nproc)
    full = [*TINY_ARGS, "--max_steps", str(STEPS), "--output_dir", str(out), "--check_sync_steps", "1",
            "--per_device_train_batch_size", str(per_rank), *args]
    run_on_two_hosts(FINETUNE, full, nproc, timeout)


LAYOUTS = {"2x1": 1, "2x2": 2}  # nodes x processes per node -> processes per node
STRATEGIES = {"ddp": [], "zero3": ["--strategy", "zero3"], "fsdp_hybrid": ["--strategy", "fsdp", "--fsdp_hybrid", "true"]}
GENERATED = ("ddp", "zero3")  # their 2x1 runs: `hftk configs --nodes 2` YAMLs under `accelerate launch`


def accelerate_two_hosts(out: Path, strategy: str, tmp: Path) -> tuple[list[int], list[str]]:
    """`hftk configs --nodes 2` YAMLs, launched with `accelerate launch --machine_rank R` on each host (one
    process each): exit codes and outputs."""
    with two_hosts() as (a, b):
        main = a.name if a.netns else a.address
        configs = tmp / f"configs-{strategy}"
        made = subprocess.run([sys.executable, "-m", "hftk.cli", "configs", "--out", str(configs), "--nodes", "2",
                               "--procs_per_node", "1", "--main_process_ip", main,
                               "--main_process_port", str(free_port())], capture_output=True, text=True, timeout=120)
        assert made.returncode == 0, made.stderr
        args = [*TINY_ARGS, "--max_steps", str(STEPS), "--output_dir", str(out), "--check_sync_steps", "1",
                "--per_device_train_batch_size", str(GLOBAL_BATCH // 2)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
               "PET_RDZV_ID": f"hftk-{out.name}"}
        accelerate = str(Path(sys.executable).parent / "accelerate")
        procs = [subprocess.Popen(host.wrap([accelerate, "launch", "--config_file", str(configs / f"{strategy}.yaml"),
                                             "--machine_rank", str(rank), str(FINETUNE), *args]),
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True)
                 for rank, host in enumerate((a, b))]
        try:
            outputs = [p.communicate(timeout=420)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
    return [p.returncode for p in procs], outputs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A single-node reference, then every strategy x layout on two hosts: ddp and zero3 at 2x1 through the
    generated multi-node configs and `accelerate launch`, the rest through torchrun."""
    root = tmp_path_factory.mktemp("multinode")
    finetune(1, ["--max_steps", str(STEPS), "--output_dir", str(root / "single"),
                 "--per_device_train_batch_size", str(GLOBAL_BATCH)])
    launched = {}
    for strategy, args in STRATEGIES.items():
        for layout, nproc in LAYOUTS.items():
            if strategy == "fsdp_hybrid" and nproc == 1:
                continue  # one process per node leaves nothing to shard inside a node
            if layout == "2x1" and strategy in GENERATED:
                launched[strategy] = accelerate_two_hosts(root / f"{strategy}-{layout}", strategy, root)
                assert launched[strategy][0] == [0, 0], "".join(o[-3000:] for o in launched[strategy][1])
            else:
                run_two_nodes(root / f"{strategy}-{layout}", nproc, args)
    (root / "launched.json").write_text(json.dumps(launched))
    return root


CASES = [(s, layout) for s in STRATEGIES for layout in LAYOUTS if not (s == "fsdp_hybrid" and layout == "2x1")]


@pytest.mark.parametrize("strategy,layout", CASES, ids=[f"{s}-{layout}" for s, layout in CASES])
def test_two_nodes_match_single_node(runs, strategy, layout):
    ref, got = losses(runs / "single"), losses(runs / f"{strategy}-{layout}")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-5), (strategy, layout, step)
    final = load_weights(runs / f"{strategy}-{layout}" / "final")
    assert max_weight_diff(load_weights(runs / "single" / "final"), final) < 1e-5


@pytest.mark.parametrize("strategy,layout", [("ddp", "2x1"), ("ddp", "2x2"), ("fsdp_hybrid", "2x2")])
def test_replicas_stay_in_sync_across_nodes(runs, strategy, layout):
    """Replicated copies (DDP ranks; HSDP's per-node replicas, gathered) are bitwise equal every step."""
    world = 2 * LAYOUTS[layout]
    sync = [m for m in metrics(runs / f"{strategy}-{layout}") if "ranks_in_sync" in m]
    assert len(sync) == STEPS and all(m["ranks_in_sync"] and len(m["param_digests"]) == world for m in sync)


# ---- node faults: restart from the latest checkpoint, or a clear error within the join timeout ----

FAULT_STEPS = 30
JOIN_TIMEOUT = 15  # the lost node is detected when it runs out; the agents rejoin a restart round in 1-3 s
FAULT_ARGS = [*TINY_ARGS, "--max_train_samples", "200", "--max_steps", str(FAULT_STEPS),
              "--per_device_train_batch_size", "4", "--save_strategy", "steps", "--save_steps", "5"]


def _elastic_node_cmd(host, main, port: int, args: list[str]) -> list[str]:
    """torchrun on one host: c10d rendezvous at ``main``, one restart allowed (what the SLURM script runs)."""
    require_ranks(2)
    return host.wrap(torchrun_command(
        1, str(FINETUNE), *args, nnodes=2,
        rendezvous=["--rdzv-backend=c10d", f"--rdzv-endpoint={main.name if main.netns else main.address}:{port}",
                    "--rdzv-id=hftk-node-fault", f"--rdzv-conf=join_timeout={JOIN_TIMEOUT}", "--max-restarts=1",
                    "--monitor-interval=1"]))


def _pids_of(tag: str, workers_only: bool) -> list[int]:
    """Processes launched with HFTK_NODE_TAG=tag (a scheduler picking its victims from outside)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"HFTK_NODE_TAG={tag}".encode() in environ and (
                not workers_only or any(e.startswith(b"LOCAL_RANK=") for e in environ)):
            found.append(int(pid))
    return found


def _run_with_node_fault(out: Path, kill: str) -> tuple[list[int], list[str], float]:
    """Two elastic nodes; once step 12 is logged, SIGKILL node 1's workers (kill='workers') or the whole
    node, agent included (kill='node'). Returns exit codes, outputs, and seconds from the kill to the end."""
    with two_hosts() as (a, b):
        port = free_port()
        procs = []
        for rank, host in enumerate((a, b)):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                   "HFTK_NODE_TAG": f"{out.name}-{rank}"}
            procs.append(subprocess.Popen(_elastic_node_cmd(host, a, port, [*FAULT_ARGS, "--output_dir", str(out)]),
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        try:
            deadline = time.time() + 400
            while not any(m.get("step", 0) >= 12 and "loss" in m for m in _metrics_or_empty(out)):
                assert time.time() < deadline and all(p.poll() is None for p in procs), "never reached step 12"
                time.sleep(0.5)
            for pid in _pids_of(f"{out.name}-1", workers_only=kill == "workers"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed_at = time.time()
            try:
                outputs = [p.communicate(timeout=JOIN_TIMEOUT + 300)[0] for p in procs]
            except subprocess.TimeoutExpired as hang:
                left = subprocess.run(["ps", "-eo", "pid,ppid,stat,wchan:24,etimes,args"], capture_output=True,
                                      text=True).stdout
                pytest.fail(f"the node-fault launch ({kill}) still runs {JOIN_TIMEOUT + 300} s after the kill; "
                            f"processes left:\n{left}\n{hang.output!r}"[-12000:])
            return [p.returncode for p in procs], outputs, time.time() - killed_at
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            # the workers run in sessions of their own: a hung launch must not leave them to the next test
            for rank in range(2):
                for pid in _pids_of(f"{out.name}-{rank}", workers_only=True):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)


def _metrics_or_empty(out: Path) -> list[dict]:
    try:
        return metrics(out)
    except (FileNotFoundError, ValueError):
        return []


@pytest.mark.timeout(1500)  # above the bounds of its own waits: 420 s, then 400 s to step 12 and 315 s after the kill
def test_killed_node_workers_restart_from_latest_checkpoint(tmp_path):
    uninterrupted = tmp_path / "uninterrupted"  # the same 2 ranks on one host (2 nodes equal one: the tests above)
    result = torchrun(2, FINETUNE, [*FAULT_ARGS, "--output_dir", str(uninterrupted)], timeout=420)
    assert result.returncode == 0, result.output[-5000:]
    faulted = tmp_path / "faulted"
    codes, outputs, _ = _run_with_node_fault(faulted, kill="workers")
    assert codes == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    resumed = re.findall(r"resuming from \S*checkpoint-(\d+)", "".join(outputs))
    assert resumed and all(5 <= int(step) < FAULT_STEPS for step in resumed), resumed
    # the surviving node re-forms the group as a membership change (its restart count stays 0):
    # it must still know this is the same job and resume, not refuse the job's own checkpoints
    assert "already holds checkpoints" not in "".join(outputs)
    assert max_weight_diff(load_weights(uninterrupted / "final"), load_weights(faulted / "final")) < 1e-6


@pytest.mark.timeout(900)  # above the bounds of its own waits: 400 s to step 12, 315 s after the kill
def test_lost_node_ends_in_a_clear_error_within_the_join_timeout(tmp_path):
    codes, outputs, seconds = _run_with_node_fault(tmp_path / "lost", kill="node")
    survivor = outputs[0]
    assert codes[0] != 0
    assert seconds < JOIN_TIMEOUT + 120, seconds
    assert "RendezvousTimeoutError" in survivor or "Connection closed by peer" in survivor, survivor[-3000:]


@pytest.mark.parametrize("strategy", GENERATED)
def test_generated_multinode_configs_launch_two_hosts(runs, strategy):
    """`hftk configs --nodes 2` YAMLs, launched with `accelerate launch --machine_rank R` on each host (the
    fixture's 2x1 runs of these strategies): both hosts finish, the strategy is the YAML's, the losses are
    the single node's."""
    codes, outputs = json.loads((runs / "launched.json").read_text())[strategy]
    assert codes == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert f"strategy {strategy}" in outputs[0] or strategy == "ddp"
    ref, got = losses(runs / "single"), losses(runs / f"{strategy}-2x1")
    assert sorted(got) == sorted(ref)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-5), (strategy, step)
