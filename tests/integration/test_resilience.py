"""Never lose a run: SIGKILL with elastic restart, SIGTERM preemption, a kill mid-save, NaN policy.

Every fault is compared with one uninterrupted 2-rank DDP run (``tests/faults.py``): after
recovery the final weights must equal it within 1e-6 and the losses after the resume point
must be the same, which needs model, optimizer, scheduler, every rank's RNG and the data
position (epoch and batch: 30 steps cross two epoch boundaries) all restored exactly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys

import pytest
import torch

from hftk.checkpoint.atomic import COMPLETE_MARKER, STAGING_DIR, is_complete, list_checkpoints
from hftk.engine.resilience import EXIT_NONFINITE, EXIT_PREEMPTED
from tests.faults import (RUN_ARGS, SAVE_STEPS, STEPS, fault_step, reference_run, side_by_side, start, wait_for_step,
                          worker_pid)
from tests.helpers import (FINETUNE, ROOT, TINY_ARGS, Launch, free_port, load_weights, losses, max_weight_diff, metrics,
                           preference_pairs, python, torchrun)

pytestmark = pytest.mark.slow
WORKERS = ROOT / "tests" / "workers"
TOLERANCE = 1e-6
ZERO3_STEPS = 20


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory.getbasetemp())[0]


def steps_of(checkpoints) -> list[int]:
    return [int(c.name.split("-")[1]) for c in checkpoints]


# ------------------------------------------------------------------ SIGKILL + elastic restart


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Rank 1 SIGKILLed at a step drawn from the fault seed; torchrun --max-restarts 2 brings the group back."""
    out = tmp_path_factory.mktemp("sigkill") / "run"
    kill_at, replay = fault_step("sigkill", 7, 23)
    run = start(2, [*RUN_ARGS, "--save_total_limit", "3"], out, max_restarts=2)
    seen = wait_for_step(run, kill_at, timeout=300)
    os.kill(worker_pid(run, rank=1), signal.SIGKILL)
    return out, run.finish(timeout=500), seen, replay


def test_sigkill_of_a_rank_restarts_and_resumes_from_newest_checkpoint(killed):
    out, result, seen, replay = killed
    assert result.returncode == 0, f"{replay}\n{result.output[-6000:]}"
    resumed = re.findall(r"hftk: resuming from (\S+) \(elastic restart 1\)", result.stderr)
    assert resumed, f"no elastic resume after a kill near step {seen}, {replay}:\n{result.output[-4000:]}"
    step = int(resumed[0].rsplit("-", 1)[1])
    assert 5 <= step <= seen + 1 and step % 5 == 0, (step, seen, replay)


def test_restarted_run_ends_with_the_uninterrupted_weights(killed, reference):
    out, _, seen, replay = killed
    diff = max_weight_diff(load_weights(reference / "final"), load_weights(out / "final"))
    assert diff <= TOLERANCE, f"killed near step {seen}, {replay}: max weight difference {diff}"


def test_rotation_keeps_the_newest_complete_checkpoints(killed):
    out = killed[0]
    assert steps_of(list_checkpoints(out)) == [20, 25, 30]  # save_total_limit 3
    assert not (out / STAGING_DIR).exists()  # nothing half-written left behind


@pytest.fixture(scope="module")
def zero3_killed(tmp_path_factory):
    """ZeRO-3 (DeepSpeed shards in every checkpoint): an uninterrupted run, then rank 0 SIGKILLed at a step drawn from the fault seed."""
    root = tmp_path_factory.mktemp("zero3")
    args = [*RUN_ARGS, "--strategy", "zero3", "--max_steps", str(ZERO3_STEPS)]
    reference = torchrun(2, FINETUNE, [*args, "--output_dir", str(root / "reference")], timeout=600)
    assert reference.returncode == 0, reference.output[-6000:]
    kill_at, replay = fault_step("zero3_sigkill", 7, ZERO3_STEPS - 6)
    run = start(2, args, root / "killed", max_restarts=2)
    seen = wait_for_step(run, kill_at, timeout=400)
    os.kill(worker_pid(run, rank=0), signal.SIGKILL)  # the rank that publishes checkpoints
    return root, run.finish(timeout=600), seen, replay


def test_zero3_run_with_a_killed_rank_ends_with_the_uninterrupted_weights(zero3_killed):
    root, result, seen, replay = zero3_killed
    assert result.returncode == 0, f"{replay}\n{result.output[-6000:]}"
    resumed = re.findall(r"hftk: resuming from \S+/checkpoint-(\d+) \(elastic restart 1\)", result.stderr)
    assert resumed and int(resumed[0]) % SAVE_STEPS == 0 and int(resumed[0]) <= seen + 1, (resumed, seen, replay)
    assert any((root / "killed" / f"checkpoint-{resumed[0]}").glob("global_step*"))  # ZeRO shards were resumed
    diff = max_weight_diff(load_weights(root / "reference" / "final"), load_weights(root / "killed" / "final"))
    assert diff <= TOLERANCE, f"killed near step {seen}, {replay}: max weight difference {diff}"


def test_hftk_push_consolidates_a_zero3_checkpoint_of_shards_only(zero3_killed, tmp_path, monkeypatch):
    """`hftk push` after the fact of a checkpoint holding only ZeRO-3 shards: consolidated first, then pushed."""
    import shutil

    import huggingface_hub.constants
    from safetensors.torch import load

    from hftk.publish.hub import push_command
    from tests.faults import TOKEN, hub_server

    root = zero3_killed[0]
    hub = hub_server()
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.base_url)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    shutil.copytree(root / "reference" / "checkpoint-10", tmp_path / "checkpoint-10")
    shutil.copy(root / "reference" / "hftk_run.json", tmp_path)
    (tmp_path / "checkpoint-10" / "model.safetensors").unlink()  # only the ZeRO shards (global_step10/) are left
    assert push_command([str(tmp_path / "checkpoint-10"), "hftk-test/zero3-shards", "--retry_backoff_s", "0.1"]) == 0
    files = hub.state.files("hftk-test/zero3-shards")
    pushed = load(files["model.safetensors"])
    gathered = load_weights(root / "reference" / "checkpoint-10")  # what ZeRO-3 itself gathered at that save
    assert max_weight_diff(gathered, {k: pushed[k] for k in gathered}) == 0.0
    assert "**zero3** over 2 process(es)" in files["README.md"].decode() and "optimizer steps: 10" in files["README.md"].decode()


# ------------------------------------------------------------------ SIGTERM preemption


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """SIGTERM to rank 1 only (no regular saves); then a plain resume from `latest`."""
    out = tmp_path_factory.mktemp("sigterm") / "run"
    args = [*RUN_ARGS, "--save_steps", "1000"]
    at, replay = fault_step("sigterm", 6, 22)
    run = start(2, args, out)
    seen = wait_for_step(run, at, timeout=300)
    os.kill(worker_pid(run, rank=1), signal.SIGTERM)
    stopped = run.finish(timeout=300)
    emergency = list_checkpoints(out)
    resumed = torchrun(2, FINETUNE, [*args, "--resume_from_checkpoint", "latest", "--output_dir", str(out)], timeout=300)
    return out, stopped, emergency, resumed, seen, replay


def test_sigterm_saves_an_emergency_checkpoint_on_every_rank_and_exits_75(preempted):
    out, stopped, emergency, _, seen, replay = preempted
    assert stopped.returncode != 0, replay
    # torchrun reports the first rank to exit with its own code (then it stops the others)
    assert re.search(rf"exitcode\s*:\s*{EXIT_PREEMPTED}\b", stopped.stderr), stopped.stderr[-4000:]
    assert len(emergency) == 1 and is_complete(emergency[0])
    step = steps_of(emergency)[0]
    assert seen <= step <= seen + 3, (seen, step, replay)
    # rank 0 got no signal: it learnt of it through the per-step all-reduce, saved its part and stopped
    assert f"hftk: stopped at step {step}: preempted (a signal on another rank)" in stopped.stderr
    assert (emergency[0] / "rng_state_0.pth").exists() and (emergency[0] / "rng_state_1.pth").exists()


def test_resume_from_the_emergency_checkpoint_reproduces_the_losses(preempted, reference):
    out, _, emergency, resumed, _, replay = preempted
    assert resumed.returncode == 0, f"{replay}\n{resumed.output[-6000:]}"
    step = steps_of(emergency)[0]
    ref, got = losses(reference), losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert got[s] == pytest.approx(ref[s], abs=TOLERANCE), (s, step, replay)
    assert max_weight_diff(load_weights(reference / "final"), load_weights(out / "final")) <= TOLERANCE


# ------------------------------------------------------------------ preemption and evaluation


GRACE_S = 30  # torchrun's --shutdown_timeout default: SIGTERM to the workers, SIGKILL this long after
EVAL_SLEEP_S = 1.0  # per decoder-block forward in eval mode: 37 eval blocks make every evaluation here > GRACE_S
EVAL_ARGS = [*TINY_ARGS, "--max_steps", "4", "--eval_strategy", "steps", "--eval_steps", "2",
             "--per_device_eval_batch_size", "1", "--per_device_train_batch_size", "4"]
ENGINES = {  # engine -> strategy options (2 ranks each)
    "trainer": ["--strategy", "ddp"],
    "pipeline": ["--strategy", "pipeline", "--pp_size", "2", "--pp_microbatches", "2"],
    "tp": ["--strategy", "tp", "--tp_size", "2"],
}


def wait_for_output(run, text: str, timeout: float) -> None:
    """Block until ``text`` appears on the run's stderr."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        if text in run.output()[1]:
            return
        if run.proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {run.proc.returncode}) before {text!r}:\n{run.output()[1][-5000:]}")
        time.sleep(0.05)
    run.kill()
    raise AssertionError(f"{text!r} not seen within {timeout}s")


def exit_codes(folder) -> dict[str, int]:
    return {f.name: int(f.read_text()) for f in sorted(folder.glob("rank-*"))}


def sigterm_as_scancel_does(run) -> tuple[Launch, float]:
    """SIGTERM as ``scancel`` sends it: to torchrun and to every worker at once; torchrun then forwards its own
    to the workers (each gets two) and kills them GRACE_S later. Returns the launch and the seconds from the
    signal to its end."""
    import time

    workers = [worker_pid(run, rank) for rank in (0, 1)]
    sent = time.time()
    for pid in (run.proc.pid, *workers):
        os.kill(pid, signal.SIGTERM)
    result = run.finish(timeout=sent - run.started + GRACE_S + 60)  # finish counts from the launch
    return result, time.time() - sent


@pytest.fixture(scope="module", params=list(ENGINES))
def eval_preempted(request, tmp_path_factory):
    """SIGTERM once the step-2 evaluation (longer than the grace period) is running; then a plain resume."""
    from tests.workers.slow_eval import EVAL_MARKER

    engine = request.param
    root = tmp_path_factory.mktemp(f"eval_preempted_{engine}")
    args = [*EVAL_ARGS, *ENGINES[engine]]
    run = start(2, args, root / "run", script=WORKERS / "slow_eval.py",
                env={"HFTK_EVAL_SLEEP_S": str(EVAL_SLEEP_S), "HFTK_EXIT_DIR": str(root / "exit")})
    wait_for_output(run, EVAL_MARKER, timeout=300)
    stopped, seconds = sigterm_as_scancel_does(run)
    emergency = list_checkpoints(root / "run")
    resumed = torchrun(2, FINETUNE, [*args, "--resume_from_checkpoint", "latest", "--output_dir", str(root / "run")],
                       timeout=400)
    return root, stopped, seconds, emergency, resumed


def test_sigterm_during_evaluation_saves_within_the_grace_period_and_exits_75(eval_preempted):
    root, stopped, seconds, emergency, _ = eval_preempted
    assert exit_codes(root / "exit") == {"rank-0": EXIT_PREEMPTED, "rank-1": EXIT_PREEMPTED}, stopped.output[-5000:]
    assert seconds < GRACE_S, f"{seconds:.1f}s from SIGTERM to exit; torchrun kills at {GRACE_S}s"
    assert steps_of(emergency) == [2] and is_complete(emergency[0])
    assert "hftk: stopped at step 2: preempted (SIGTERM) during evaluation" in stopped.stderr, stopped.stderr[-4000:]
    assert "Unable to shutdown process" not in stopped.stderr  # torchrun never had to SIGKILL


@pytest.fixture(scope="module")
def eval_reference(tmp_path_factory):
    """The Trainer run of EVAL_ARGS, uninterrupted."""
    out = tmp_path_factory.mktemp("eval_reference") / "run"
    result = torchrun(2, FINETUNE, [*EVAL_ARGS, *ENGINES["trainer"], "--output_dir", str(out)], timeout=400)
    assert result.returncode == 0, result.output[-6000:]
    return out


def test_a_checkpoint_saved_in_an_interrupted_evaluation_resumes(eval_preempted, request):
    root, _, _, _, resumed = eval_preempted
    assert resumed.returncode == 0, resumed.output[-6000:]
    assert re.search(r"hftk: resuming from \S+/checkpoint-2\b", resumed.stderr), resumed.stderr[-3000:]
    assert {m["step"] for m in metrics(root / "run") if "eval_loss" in m} == {4}  # the interrupted one logged nothing
    assert sorted(losses(root / "run")) == [1, 2, 3, 4]
    assert (root / "run" / "final" / "config.json").exists()
    if request.node.callspec.params["eval_preempted"] == "trainer":  # exactly the uninterrupted run
        reference = request.getfixturevalue("eval_reference")
        ref, got = losses(reference), losses(root / "run")
        assert all(got[s] == pytest.approx(ref[s], abs=TOLERANCE) for s in ref), (ref, got)
        assert max_weight_diff(load_weights(reference / "final"), load_weights(root / "run" / "final")) <= TOLERANCE


@pytest.mark.parametrize("engine", ["trainer", "tp"])
def test_sigterm_in_the_step_before_an_evaluation_saves_without_evaluating(engine, tmp_path):
    """The signal lands inside step 2 (each step sleeps 4 s: 2 s per block, a window wide enough for torchrun's
    forwarding on a loaded machine); step 2's evaluation is due next and must not run."""
    from tests.workers.slow_eval import EVAL_MARKER

    run = start(2, [*EVAL_ARGS, *ENGINES[engine]], tmp_path / "run", script=WORKERS / "slow_eval.py",
                env={"HFTK_TRAIN_SLEEP_S": "2", "HFTK_EVAL_SLEEP_S": str(EVAL_SLEEP_S),
                     "HFTK_EXIT_DIR": str(tmp_path / "exit")})
    assert wait_for_step(run, 1, timeout=300) == 1
    stopped, seconds = sigterm_as_scancel_does(run)
    assert exit_codes(tmp_path / "exit") == {"rank-0": EXIT_PREEMPTED, "rank-1": EXIT_PREEMPTED}, stopped.output[-5000:]
    assert "hftk: stopped at step 2: preempted (SIGTERM);" in stopped.stderr, stopped.stderr[-4000:]
    assert EVAL_MARKER not in stopped.stderr and not any("eval_loss" in m for m in metrics(tmp_path / "run"))
    assert steps_of(list_checkpoints(tmp_path / "run")) == [2] and is_complete(tmp_path / "run" / "checkpoint-2")
    assert seconds < GRACE_S


@pytest.mark.parametrize("engine", list(ENGINES))
def test_sigterm_during_the_final_evaluation_saves_the_last_step_and_exits_75(engine, tmp_path):
    """No evaluation during training: the one after the last step (outside the Trainer's loop on its path)."""
    from tests.workers.slow_eval import EVAL_MARKER

    args = [*TINY_ARGS, "--max_steps", "2", "--per_device_eval_batch_size", "1", "--per_device_train_batch_size", "4"]
    run = start(2, [*args, *ENGINES[engine]], tmp_path / "run", script=WORKERS / "slow_eval.py",
                env={"HFTK_EVAL_SLEEP_S": str(EVAL_SLEEP_S), "HFTK_EXIT_DIR": str(tmp_path / "exit")})
    wait_for_output(run, EVAL_MARKER, timeout=300)
    stopped, seconds = sigterm_as_scancel_does(run)
    assert exit_codes(tmp_path / "exit") == {"rank-0": EXIT_PREEMPTED, "rank-1": EXIT_PREEMPTED}, stopped.output[-5000:]
    assert "hftk: stopped at step 2: preempted (SIGTERM) during evaluation" in stopped.stderr, stopped.stderr[-4000:]
    assert steps_of(list_checkpoints(tmp_path / "run")) == [2] and is_complete(tmp_path / "run" / "checkpoint-2")
    assert not (tmp_path / "run" / "final").exists() and seconds < GRACE_S


# ------------------------------------------------------------------ kill during a checkpoint write


@pytest.fixture(scope="module")
def torn(tmp_path_factory):
    """Rank 0 dies while writing checkpoint-10 (torn optimizer.pt); one restart allowed."""
    out = tmp_path_factory.mktemp("torn") / "run"
    run = start(2, RUN_ARGS, out, max_restarts=1, script=WORKERS / "die_in_save.py", env={"HFTK_DIE_AT_STEP": "10"})
    return out, run.finish(timeout=500)


def test_kill_during_a_save_resumes_from_the_previous_checkpoint(torn, reference):
    out, result = torn
    assert result.returncode == 0, result.output[-6000:]
    assert re.search(rf"hftk: discarded incomplete save \S+/{STAGING_DIR}/checkpoint-10\b", result.stderr)
    assert re.search(r"hftk: resuming from \S+/checkpoint-5 \(elastic restart 1\)", result.stderr), result.stderr[-4000:]
    assert max_weight_diff(load_weights(reference / "final"), load_weights(out / "final")) <= TOLERANCE


def test_the_previous_checkpoint_was_left_intact(torn, reference):
    out, _ = torn
    assert is_complete(out / "checkpoint-5")
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):
        assert (out / "checkpoint-5" / name).read_bytes() == (reference / "checkpoint-5" / name).read_bytes(), name
    assert steps_of(list_checkpoints(out)) == list(range(5, STEPS + 1, 5))


def test_a_checkpoint_without_its_marker_is_never_picked(tmp_path, reference):
    import shutil

    from hftk.checkpoint.atomic import resolve_resume

    for step in (5, 10):
        shutil.copytree(reference / f"checkpoint-{step}", tmp_path / f"checkpoint-{step}")
    (tmp_path / "checkpoint-10" / COMPLETE_MARKER).unlink()
    assert resolve_resume(tmp_path, "latest") == str(tmp_path / "checkpoint-5")
    (tmp_path / "checkpoint-5" / "optimizer.pt").write_bytes(b"truncated")  # size no longer matches the marker
    assert resolve_resume(tmp_path, "latest") is None


# ------------------------------------------------------------------ NaN / Inf policy


@pytest.fixture(scope="module")
def nan_runs(tmp_path_factory):
    """One process, NaN loss at step 3: policy skip (saving every step) and policy stop."""
    root = tmp_path_factory.mktemp("nan")
    common = [*TINY_ARGS, "--max_steps", "6", "--save_strategy", "steps", "--save_total_limit", "0"]
    cmds = {
        "skip": [*common, "--save_steps", "1", "--nan_policy", "skip", "--output_dir", str(root / "skip")],
        "stop": [*common, "--save_steps", "100", "--nan_policy", "stop", "--output_dir", str(root / "stop")],
    }
    launches = {k: python([str(WORKERS / "nan_loss.py"), *a], timeout=300, env={"HFTK_NAN_AT_STEP": "3"})
                for k, a in cmds.items()}
    return root, {k: (launch.returncode, launch.output) for k, launch in launches.items()}


def _optimizer_state(checkpoint):
    return torch.load(checkpoint / "optimizer.pt", weights_only=True)["state"]


def test_nan_policy_skip_drops_exactly_that_update(nan_runs):
    root, results = nan_runs
    rc, err = results["skip"]
    assert rc == 0, err[-4000:]
    run = root / "skip"
    before, during, after = (load_weights(run / f"checkpoint-{s}") for s in (2, 3, 4))
    assert max_weight_diff(before, during) == 0.0  # the NaN step changed no weight...
    state2, state3 = _optimizer_state(run / "checkpoint-2"), _optimizer_state(run / "checkpoint-3")
    for key in state2:  # ...and no optimizer moment
        for name, value in state2[key].items():
            assert torch.equal(value, state3[key][name]), (key, name)
    assert max_weight_diff(during, after) > 0 and all(torch.isfinite(t).all() for t in after.values())
    assert "non-finite gradient" in err


def test_nan_policy_stop_saves_the_last_finite_state_and_exits_65(nan_runs):
    root, results = nan_runs
    rc, err = results["stop"]
    assert rc == EXIT_NONFINITE, err[-4000:]
    assert "hftk: stopped at step 3: a NaN/Inf loss" in err
    assert steps_of(list_checkpoints(root / "stop")) == [3]
    saved = load_weights(root / "stop" / "checkpoint-3")
    assert max_weight_diff(saved, load_weights(root / "skip" / "checkpoint-2")) == 0.0
    assert not (root / "stop" / "final").exists()


# ------------------------------------------------------------------ restarts torch cannot carry out


LAUNCHES = {  # name -> (torchrun options, TORCH_DISABLE_SHARE_RDZV_TCP_STORE, refused)
    "static": (["--max-restarts=1", "--master_addr=127.0.0.1"], "0", True),  # torchrun's default rendezvous
    "c10d_shared_store": (["--max-restarts=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"], "0", True),
    "c10d_fresh_store": (["--max-restarts=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"], "1", False),
}


@pytest.fixture(scope="module")
def elastic_envs(tmp_path_factory):
    """What real torchrun launches tell their workers (three launches side by side)."""
    root = tmp_path_factory.mktemp("elastic_env")
    cmds = {name: [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                   *options, str(WORKERS / "elastic_env.py"), str(root / f"{name}.json")]
            for name, (options, _, _) in LAUNCHES.items()}
    env = {name: {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": share} for name, (_, share, _) in LAUNCHES.items()}
    for name, (rc, output) in side_by_side(cmds, env, root, timeout=180).items():
        assert rc == 0, output[-3000:]
    return {name: json.loads((root / f"{name}.json").read_text()) for name in LAUNCHES}


@pytest.mark.parametrize("name", LAUNCHES)
def test_restarts_torch_cannot_carry_out_are_refused_before_training(elastic_envs, name):
    from hftk.core.errors import HftkError
    from hftk.engine.resilience import check_restartable

    if LAUNCHES[name][2]:
        with pytest.raises(HftkError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
            check_restartable(elastic_envs[name])
    else:
        check_restartable(elastic_envs[name])


# ------------------------------------------------------------------ a tokenisation longer than ddp_timeout


def test_a_tokenisation_longer_than_ddp_timeout_does_not_time_out_the_waiting_rank(tmp_path):
    """Rank 0 tokenises for 12 s (tests/workers/slow_tokenize.py) under ``--ddp_timeout 5``: rank 1 waits on the
    launcher's store, not in a collective (in ``TrainingArguments.main_process_first``'s barrier it died after 5 s)."""
    from tests.helpers import torchrun
    from tests.workers.slow_tokenize import TIMEOUT_MARKER

    result = torchrun(2, WORKERS / "slow_tokenize.py",
                      [*TINY_ARGS, "--max_steps", "2", "--ddp_timeout", "5", "--output_dir", str(tmp_path / "run")],
                      env={"HFTK_TOKENIZE_SLEEP_S": "12"}, timeout=400)
    assert result.returncode == 0, result.output[-6000:]
    assert result.stderr.count(f"{TIMEOUT_MARKER} 5.0 s") == 2, result.stderr[-3000:]  # the timeout was in force
    assert sorted(losses(tmp_path / "run")) == [1, 2] and (tmp_path / "run" / "final" / "model.safetensors").is_file()


# ------------------------------------------------------------------ preemption of a DPO run


def test_sigterm_during_dpo_saves_exits_75_and_the_resume_equals_the_uninterrupted_run(tmp_path):
    """DPO under the Trainer's preemption path: SIGTERM as scancel sends it (steps slowed so it lands mid-run)
    seals one checkpoint and exits 75 on both ranks; resuming it gives the uninterrupted run's losses, DPO
    rewards and final weights (the reference is reloaded, not checkpointed)."""
    data = preference_pairs(tmp_path / "prefs.jsonl", 48, 0)
    args = [*TINY_ARGS, "--method", "dpo", "--dataset", str(data), "--max_steps", "8", "--eval_fraction", "0",
            "--per_device_train_batch_size", "4", "--save_strategy", "no"]
    reference = tmp_path / "uninterrupted"
    done = torchrun(2, FINETUNE, [*args, "--output_dir", str(reference)], timeout=300)
    assert done.returncode == 0, done.output[-5000:]
    at, replay = fault_step("dpo_sigterm", 2, 5)
    run = start(2, args, tmp_path / "run", script=WORKERS / "slow_eval.py",
                env={"HFTK_TRAIN_SLEEP_S": "0.3", "HFTK_EXIT_DIR": str(tmp_path / "exit")})
    wait_for_step(run, at, timeout=300)
    stopped, _ = sigterm_as_scancel_does(run)
    assert exit_codes(tmp_path / "exit") == {"rank-0": EXIT_PREEMPTED, "rank-1": EXIT_PREEMPTED}, \
        f"{replay}\n{stopped.output[-5000:]}"
    emergency = list_checkpoints(tmp_path / "run")
    assert len(emergency) == 1 and is_complete(emergency[0]) and steps_of(emergency)[0] < 8, (emergency, replay)
    resumed = torchrun(2, FINETUNE, [*args, "--resume_from_checkpoint", "latest", "--output_dir", str(tmp_path / "run")],
                       timeout=300)
    assert resumed.returncode == 0, resumed.output[-5000:]
    ours = {m["step"]: m for m in metrics(tmp_path / "run") if "rewards/chosen" in m}
    theirs = {m["step"]: m for m in metrics(reference) if "rewards/chosen" in m}
    assert sorted(ours) == sorted(theirs) == list(range(1, 9)), replay
    for step in theirs:
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert ours[step][key] == pytest.approx(theirs[step][key], abs=TOLERANCE), (step, key, replay)
    assert max_weight_diff(load_weights(reference / "final"), load_weights(tmp_path / "run" / "final")) <= TOLERANCE
