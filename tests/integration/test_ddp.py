"""DDP over gloo: really 2 ranks, replicas in sync, losses equal a plain ``transformers.Trainer`` on one
process (tests/reference/plain.py, no hftk), exact resume."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers import finetune, load_weights, losses, max_weight_diff, metrics, plain_reference, wandb_run

pytestmark = pytest.mark.slow
STEPS = 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A plain Trainer on one process (the reference) and a 2-rank DDP run with the same global batch (8)."""
    root = tmp_path_factory.mktemp("ddp")
    single = plain_reference("trainer", root / "single", ["--max_steps", str(STEPS), "--batch_size", "8"])
    ddp = finetune(2, ["--max_steps", str(STEPS), "--save_strategy", "steps", "--save_steps", "4",
                       "--check_sync_steps", "1", "--output_dir", str(root / "ddp"), "--per_device_train_batch_size",
                       "4", "--report_to", "wandb"])
    return root, single, ddp


def test_world_size_is_two(runs):
    root, _, ddp = runs
    sync = [m for m in metrics(root / "ddp") if "param_digests" in m]
    assert sync and all(len(m["param_digests"]) == 2 for m in sync)
    # epoch advances twice as fast per step when two ranks split the data
    single_epoch = [m["epoch"] for m in metrics(root / "single") if "loss" in m][0]
    ddp_epoch = [m["epoch"] for m in metrics(root / "ddp") if "loss" in m][0]
    assert ddp_epoch == pytest.approx(single_epoch, rel=0.05)


def test_wandb_runs_offline_without_a_key_and_records_every_loss(runs):
    root, _, _ = runs
    run = wandb_run(root / "ddp")  # one run: rank 0's
    logged = {row["train/global_step"]: row["train/loss"] for row in run["history"] if "train/loss" in row}
    assert logged == pytest.approx(losses(root / "ddp"), abs=1e-6)  # hftk's throughput and memory beside it:
    assert all("train/tokens_per_s" in row and "train/peak_mem_mb_max" in row
               for row in run["history"] if "train/loss" in row)
    assert run["config"]["per_device_train_batch_size"] == 4


def test_replicas_identical_after_every_step(runs):
    root, _, _ = runs
    sync = [m for m in metrics(root / "ddp") if "ranks_in_sync" in m]
    assert [m["step"] for m in sync] == list(range(1, STEPS + 1))
    assert all(m["ranks_in_sync"] for m in sync)


def test_losses_match_a_plain_trainer_on_one_process(runs):
    root, _, _ = runs
    ref, got = losses(root / "single"), losses(root / "ddp")
    assert sorted(ref) == sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-5), step
    assert ref[STEPS] < ref[1]  # it learns
    assert max_weight_diff(load_weights(root / "single" / "final"), load_weights(root / "ddp" / "final")) < 1e-5


def test_resume_from_mid_run_checkpoint_is_exact(runs, tmp_path):
    root, _, _ = runs
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(root / "ddp" / "checkpoint-4", resumed / "checkpoint-4")
    finetune(2, ["--max_steps", str(STEPS), "--output_dir", str(resumed), "--per_device_train_batch_size", "4",
                 "--resume_from_checkpoint", "latest"])
    full, after = losses(root / "ddp"), losses(resumed)
    assert sorted(after) == list(range(5, STEPS + 1))
    for step in after:
        assert after[step] == pytest.approx(full[step], abs=1e-6), step
    assert max_weight_diff(load_weights(root / "ddp" / "final"), load_weights(resumed / "final")) < 1e-6
