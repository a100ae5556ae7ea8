"""The warm-rank harness (tests/warm.py) that most multi-process tests run on: a cell is as fresh as a
launch (nothing an earlier cell left behind changes it), and a cell that hangs or crashes is killed
with its ranks and reported with its output while the next cell still runs."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests import warm
from tests.helpers import ROOT, TINY_ARGS, finetune, losses, rank_exit_codes, torchrun

pytestmark = pytest.mark.slow
MISBEHAVE = ROOT / "tests" / "workers" / "misbehave.py"
SHORT = ["--max_steps", "3", "--attn_implementation", "sdpa"]


def test_a_cell_is_not_changed_by_what_an_earlier_cell_left_behind(tmp_path):
    first = tmp_path / "first"
    finetune(2, [*SHORT, "--output_dir", str(first)])
    dirty = tmp_path / "dirty"
    polluted = torchrun(2, MISBEHAVE, ["pollute", *TINY_ARGS, *SHORT, "--output_dir", str(dirty)], timeout=300)
    assert polluted.returncode == 0, polluted.output[-4000:]
    assert polluted.stdout.count("polluted rank") == 2
    # what it left behind does change a run: the same cell computed under it differs
    assert max(abs(losses(dirty)[s] - losses(first)[s]) for s in (1, 2, 3)) > 0.05, (losses(dirty), losses(first))
    again = tmp_path / "again"
    finetune(2, [*SHORT, "--output_dir", str(again)])
    assert losses(again) == losses(first)  # bit for bit, as a fresh launch


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("mode", ["hang", "crash"])
def test_a_hung_or_crashed_cell_is_killed_with_its_ranks_and_the_next_cell_runs(mode, tmp_path):
    started = time.monotonic()
    if mode == "hang":
        with pytest.raises(AssertionError, match=r"warm launch timed out after 5s") as failed:
            torchrun(2, MISBEHAVE, ["hang"], timeout=5)
        output = str(failed.value)
    else:
        result = torchrun(2, MISBEHAVE, ["crash"], timeout=120)
        assert result.returncode == 1  # torchrun's status when a worker failed
        output = result.output
        assert "RuntimeError: rank 1 fails on purpose" in output
        assert rank_exit_codes(result)[1] == 1, output  # rank 0 exits on its own or by the supervisor's SIGTERM
    assert time.monotonic() - started < 60
    pids = [int(p) for p in re.findall(r"rank \d pid (\d+)", output)]
    assert len(pids) == 2, output  # its output came back, both ranks' lines
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), "a rank outlived its cell"
    finetune(2, ["--max_steps", "1", "--output_dir", str(tmp_path / "next")])


CRASHING_CELL = '''
import ctypes, os, sys
from pathlib import Path
import signal, time
runs_file = Path(sys.argv[1])
if os.environ["RANK"] == "0":
    runs_file.write_text(runs_file.read_text() + "run\\n" if runs_file.exists() else "run\\n")
    time.sleep(0.5)
    ctypes.string_at(0)  # a real SIGSEGV, as a library's bug raises it
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 1 outlives rank 0 and buries its stacks in later output
time.sleep(1.5)
for i in range(200):
    print("rank 1 goes on", "." * 80, flush=True)
'''


def test_a_cell_whose_rank_segfaults_fails_once_with_the_signal_and_its_stacks(tmp_path):
    """A rank killed by SIGSEGV fails its cell, which runs once: no rerun hides it, and the output says which
    rank, which signal, and where (faulthandler's stacks, repeated after the exit codes: the tail a failing test
    prints holds them even when another rank wrote on), so the cause can be found from one failure."""
    script, runs_file = tmp_path / "crashing_cell.py", tmp_path / "runs"
    script.write_text(CRASHING_CELL)
    result = torchrun(2, script, [runs_file], timeout=120)
    assert result.returncode == 1 and rank_exit_codes(result)[0] == -signal.SIGSEGV, result.output
    assert runs_file.read_text().splitlines() == ["run"]
    assert "Fatal Python error: Segmentation fault" in result.output and "crashing_cell.py" in result.output
    tail = result.output[-6000:]  # what a failing test prints: the dead rank's stacks are still there
    assert warm.LAST_WORDS in tail and "crashing_cell.py" in tail.split(warm.LAST_WORDS)[1], tail


WANDB_CELL = '''
import os, sys
import wandb
from wandb.sdk.data_types._private import MEDIA_TMP

run = wandb.init(mode="offline", dir=sys.argv[1])
run.log({"table": wandb.Table(columns=["a"], data=[["x"]])})  # staged in wandb's media folder
run.finish()
print("media", MEDIA_TMP.name, os.path.isdir(MEDIA_TMP.name))
'''


def test_a_cell_that_used_wandb_leaves_the_next_cells_media_folder_alone(tmp_path):
    """wandb stages media in a folder made at its import (in the warm server) and deletes it at exit: a finished
    cell must not take it from the next one (a later Table log then failed with FileNotFoundError)."""
    from tests.helpers import python

    script = tmp_path / "wandb_cell.py"
    script.write_text(WANDB_CELL)
    folders = []
    for run in ("first", "second"):
        (tmp_path / run).mkdir()
        result = python([str(script), str(tmp_path / run)], timeout=300)
        assert result.returncode == 0, result.output[-4000:]
        (line,) = [line for line in result.stdout.splitlines() if line.startswith("media ")]
        assert line.endswith(" True"), line
        folders.append(line.split()[1])
    assert folders[0] != folders[1] and not any(os.path.exists(f) for f in folders)  # each its own, removed at exit


def test_the_torchrun_command_line_on_warm_ranks_reports_crashes_refuses_another_environment_and_dies_with_its_ranks():
    """tests/warm_torchrun.py, what hftk bench launches in the suite: a crash comes back as torchrun's status with
    the ranks' output; a cell whose environment needs another server is refused by name; killing the command
    (the bench's own timeout) kills its ranks."""
    import subprocess
    import sys

    from tests.warm_torchrun import SOCKET_ENV

    server = warm.server_for(warm.cell_env())
    server.wait_ready()
    command = [sys.executable, str(ROOT / "tests" / "warm_torchrun.py"), "--nproc_per_node=2", "--nnodes=1", str(MISBEHAVE)]
    env = warm.cell_env({SOCKET_ENV: server.path})

    crashed = subprocess.run([*command, "crash"], env=env, capture_output=True, text=True, timeout=120)
    assert crashed.returncode == 1 and "RuntimeError: rank 1 fails on purpose" in crashed.stderr, crashed
    elsewhere = subprocess.run([*command, "crash"], env={**env, "HF_ENDPOINT": "http://127.0.0.1:9"},
                               capture_output=True, text=True, timeout=60)
    assert elsewhere.returncode == 2 and "started without the cell's HF_ENDPOINT" in elsewhere.stderr, elsewhere

    hung = subprocess.Popen([*command, "hang"], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    pids, seen = [], []
    while len(pids) < 2 and (line := hung.stdout.readline()):  # "rank R pid P" from both ranks
        seen.append(line)
        pids += [int(p) for p in re.findall(r"rank \d pid (\d+)", line)]
    assert len(pids) == 2, seen
    os.killpg(hung.pid, signal.SIGKILL)
    hung.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), "a rank outlived its killed launcher"
