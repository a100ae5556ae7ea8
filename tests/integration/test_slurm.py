"""The SLURM batch script: valid bash, a dry run with a faked SLURM environment prints the right per-node
launches, and the time-limit warning reaches the launch as SIGTERM (a stand-in ``srun``: no SLURM here)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from tests.helpers import ROOT

SCRIPT = ROOT / "scripts" / "slurm" / "finetune.sbatch"


def _slurm_env(tmp_path: Path, **env: str) -> dict[str, str]:
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    scontrol = fake / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "gpu-node-07\\ngpu-node-08\\ngpu-node-09\\n"\n')
    scontrol.chmod(0o755)
    slurm = {"SLURM_SUBMIT_DIR": str(ROOT), "SLURM_NNODES": "3", "SLURM_JOB_ID": "4242",
             "SLURM_JOB_NODELIST": "gpu-node-[07-09]", "SLURM_GPUS_ON_NODE": "8", "HFTK_DRY_RUN": "1"}
    return {**os.environ, **slurm, **env, "PATH": f"{fake}:{os.environ['PATH']}"}


def _dry_run(tmp_path: Path, strategy: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), strategy, *args], capture_output=True, text=True,
                          env=_slurm_env(tmp_path, **env), timeout=60)


def test_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


def test_dry_run_prints_one_launch_per_node(tmp_path):
    result = _dry_run(tmp_path, "ddp", "--block_size", "256", "--dataset", "my data.jsonl")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["node 0", "node 1", "node 2"]
    for rank, line in enumerate(lines):
        argv = shlex.split(line.split(": ", 1)[1].split("&& exec ", 1)[1])
        opt = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
        assert argv[0].endswith("/accelerate") and argv[1] == "launch"
        assert opt["--config_file"].endswith("accelerate_configs/ddp.yaml")
        assert opt["--num_machines"] == "3" and opt["--num_processes"] == "24"  # 3 nodes x 8 GPUs
        assert opt["--machine_rank"] == str(rank)
        assert opt["--main_process_ip"] == "gpu-node-07"  # first host of the allocation
        assert opt["--rdzv_backend"] == "c10d" and "join_timeout" in opt["--rdzv_conf"]
        assert opt["--strategy"] == "ddp" and opt["--resume_from_checkpoint"] == "latest"
        assert argv[-2:] == ["--dataset", "my data.jsonl"]  # user options survive quoting
        assert "PET_RDZV_ID=hftk-4242" in line  # the rendezvous id is the job id
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in line  # restarts get a fresh store


def test_procs_per_node_override_and_unknown_strategy(tmp_path):
    result = _dry_run(tmp_path, "ddp", PROCS_PER_NODE="2")
    assert result.returncode == 0 and "--num_processes 6 " in result.stdout
    bad = _dry_run(tmp_path, "zero9")
    assert bad.returncode == 2 and "no launch config" in bad.stderr


def test_outside_slurm_is_a_clear_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(["bash", str(SCRIPT), "ddp"], capture_output=True, text=True, env=env, timeout=30)
    assert result.returncode != 0 and "not inside a SLURM allocation" in result.stderr


FAKE_SRUN = """#!/bin/bash
# Stand-in for srun: says it started, then behaves like a preempted launch (exit 75 on SIGTERM).
trap 'echo TERM > "$HFTK_FAKE_DIR/signal"; exit 75' TERM
touch "$HFTK_FAKE_DIR/started"
for _ in $(seq 600); do sleep 0.1; done
"""


def _default_signals() -> None:
    """The batch shell starts as slurmstepd starts it, with the default actions: bash cannot trap a signal that was
    ignored when it started, and whatever ran earlier in this test process may have left one ignored."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)


def test_the_time_limit_warning_reaches_the_launch_as_sigterm(tmp_path):
    """``#SBATCH --signal=B:USR1@300`` signals the batch shell only; it must pass SIGTERM on to srun (which
    forwards it to each node's launcher) and exit with srun's status (75: preempted, resume me)."""
    import signal
    import time

    assert "#SBATCH --signal=B:USR1@" in SCRIPT.read_text()
    env = {k: v for k, v in _slurm_env(tmp_path).items() if k != "HFTK_DRY_RUN"}
    (tmp_path / "bin" / "srun").write_text(FAKE_SRUN)
    (tmp_path / "bin" / "srun").chmod(0o755)
    env["HFTK_FAKE_DIR"] = str(tmp_path)
    batch = subprocess.Popen(["bash", str(SCRIPT), "ddp"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, preexec_fn=_default_signals)
    deadline = time.time() + 30
    while not (tmp_path / "started").exists() and time.time() < deadline:
        time.sleep(0.05)
    batch.send_signal(signal.SIGUSR1)
    _, stderr = batch.communicate(timeout=30)
    assert (tmp_path / "signal").read_text().strip() == "TERM", stderr
    assert batch.returncode == 75, stderr
