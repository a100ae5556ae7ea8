"""Faults a long run meets (issue 18, part 4): the disk fills up during a save; the world size
changes between a save and its resume.

A save that runs out of room must leave the previous checkpoint and ``latest`` as they were and
stop every rank with one line (path, bytes needed), no traceback; the run then resumes from that
checkpoint with the same losses.
"""

from __future__ import annotations

import json
import re
import resource
import shutil
import signal

import pytest
import torch

from hftk.bench.launch import torchrun_command
from hftk.checkpoint import COMPLETE_MARKER, STAGING_DIR, list_checkpoints, resolve_resume, seal, staged_folder
from hftk.config import load_config
from hftk.errors import HftkError
from hftk.validate import check_world_change
from tests.helpers import (FINETUNE, ROOT, TINY_ARGS, finetune, load_weights, losses, max_weight_diff, run,
                           torchrun)

WORKERS = ROOT / "tests" / "workers"
FULL_BYTES = 300_000  # the tiny model's weights (~1 MB) and optimizer state no longer fit; its RNG files do
DISK_ARGS = ["--max_train_samples", "200", "--max_steps", "10", "--per_device_train_batch_size", "2",
             "--save_strategy", "steps", "--save_steps", "5", "--save_total_limit", "0"]
PIPELINE = ["--strategy", "pipeline", "--pp_size", "2", "--pp_microbatches", "2"]
TP = ["--strategy", "tp", "--tp_size", "2", "--model_name_or_path", "builtin:llama-tiny"]  # DCP shards


def assert_stopped_by_a_full_disk(result, out) -> None:
    """Ranks exit 2 (torchrun then fails with 1 and its own summary), hftk's line once (the folder, the
    bytes needed) and no traceback before that summary; checkpoint-5 still complete and latest."""
    assert result.returncode != 0 and "failed (exitcode: 2)" in result.output, result.output[-5000:]
    lines = [line for line in result.output.splitlines() if line.startswith("hftk: error")]
    assert len(lines) == 1, result.output[-5000:]
    assert re.search(rf"saving {re.escape(str(out / 'checkpoint-10'))} failed: a file outgrew the file size limit "
                     rf"\(RLIMIT_FSIZE: {FULL_BYTES} bytes per file\)\. It needs about \d+ bytes \(the size of "
                     r"checkpoint-5\)", lines[0]), lines[0]
    assert "checkpoint-5 is intact and still the latest" in lines[0]
    assert "Traceback" not in result.output.split("/torch/distributed/elastic/")[0], result.output[-5000:]
    assert [c.name for c in list_checkpoints(out)] == ["checkpoint-5"]
    assert not (out / STAGING_DIR).exists() and not (out / "checkpoint-10").exists()
    assert resolve_resume(out, "latest") == str(out / "checkpoint-5")


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["trainer", "zero2", "fsdp", "pipeline", "tp"])
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint_and_stops_with_one_line(engine, tmp_path):
    """zero2 and fsdp: rank 0's model file fails before the optimizer save's collectives (DeepSpeed's
    barrier, FSDP's gather); without held write failures rank 1 waited there for the process-group timeout."""
    out = tmp_path / "run"
    extra = {"trainer": [], "zero2": ["--strategy", "zero2"], "fsdp": ["--strategy", "fsdp"], "pipeline": PIPELINE,
             "tp": TP}[engine]
    full = torchrun(2, WORKERS / "fill_disk.py", [*TINY_ARGS, *DISK_ARGS, *extra, "--output_dir", str(out)],
                    timeout=400, env={"HFTK_FULL_AFTER_STEP": "5", "HFTK_FULL_BYTES": str(FULL_BYTES)})
    assert_stopped_by_a_full_disk(full, out)
    before = losses(out)
    assert sorted(before) == list(range(1, 11)), before  # steps 6-10 trained; only their save failed
    resumed = finetune(2, [*DISK_ARGS, *extra, "--output_dir", str(out), "--resume_from_checkpoint", "latest"],
                       timeout=400)
    assert f"hftk: resuming from {out / 'checkpoint-5'}" in resumed.stderr, resumed.stderr[-3000:]
    after = losses(out)
    for step in range(6, 11):
        assert abs(after[step] - before[step]) <= 1e-6, (step, before[step], after[step])
    assert [c.name for c in list_checkpoints(out)] == ["checkpoint-5", "checkpoint-10"]


def torch_save(folder):
    torch.save(torch.zeros(50_000), folder / "optimizer.pt")


def dcp_save(folder):  # DCP gathers the failure into a CheckpointException, a BaseException
    import torch.distributed.checkpoint as dcp

    dcp.save({"optimizer": torch.zeros(50_000)}, checkpoint_id=str(folder / "dcp"), no_dist=True)


@pytest.mark.parametrize("write", [torch_save, dcp_save])
def test_a_write_refused_by_the_file_size_limit_is_named_even_when_torch_hides_the_errno(write, tmp_path):
    """torch's zip writer reports a refused write as "unexpected pos", without the errno: the limit is read."""
    previous = tmp_path / "checkpoint-1"
    previous.mkdir()
    (previous / "optimizer.pt").write_bytes(b"x" * 200_000)
    seal(previous, 1)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, limits[1]))
    try:
        with pytest.raises(HftkError) as caught, staged_folder(tmp_path / "checkpoint-2", publisher=True) as folder:
            write(folder)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    line = caught.value.one_line()
    assert line.startswith(f"training.output_dir: saving {tmp_path / 'checkpoint-2'} failed: a file outgrew the file "
                           "size limit (RLIMIT_FSIZE: 100000 bytes per file). It needs about 200"), line
    assert "checkpoint-1 is intact and still the latest" in line and "--resume_from_checkpoint latest" in line
    assert not (tmp_path / STAGING_DIR).exists() and list_checkpoints(tmp_path) == [previous]


def test_a_failure_that_is_not_a_full_disk_is_raised_as_it_is(tmp_path):
    with pytest.raises(ValueError, match="a bug"), staged_folder(tmp_path / "checkpoint-2", publisher=True):
        raise ValueError("a bug")
    assert not (tmp_path / STAGING_DIR).exists() and not (tmp_path / "checkpoint-2").exists()


# ------------------------------------------------------------------ another world size at resume

WORLD_ARGS = ["--max_train_samples", "400", "--max_steps", "10", "--per_device_train_batch_size", "2",
              "--save_strategy", "steps", "--save_steps", "5", "--save_total_limit", "0"]


@pytest.mark.slow
def test_ddp_saved_on_two_ranks_resumes_exactly_on_one_with_the_global_batch_kept(tmp_path):
    """2 ranks x batch 2 -> 1 rank x batch 2 x accumulation 2: the same samples per step, in the same order."""
    two, one = tmp_path / "two", tmp_path / "one"
    finetune(2, [*WORLD_ARGS, "--output_dir", str(two)], timeout=400)
    shutil.copytree(two / "checkpoint-5", one / "checkpoint-5")
    resumed = finetune(1, [*WORLD_ARGS, "--gradient_accumulation_steps", "2", "--output_dir", str(one),
                           "--resume_from_checkpoint", "latest"], timeout=400)
    assert f"hftk: resuming from {one / 'checkpoint-5'} (saved by 2 ranks, resumed on 1 with the same global batch" \
        in resumed.stderr, resumed.stderr[-3000:]
    reference, after = losses(two), losses(one)
    assert sorted(after) == list(range(6, 11)), after
    for step in range(6, 11):
        assert abs(after[step] - reference[step]) <= 1e-5, (step, reference[step], after[step])
    assert max_weight_diff(load_weights(two / "final"), load_weights(one / "final")) <= 1e-5



@pytest.mark.slow
def test_zero2_saved_on_two_ranks_resumes_exactly_on_one_through_a_universal_checkpoint(tmp_path):
    """ZeRO-2 keeps one optimizer partition per rank; hftk converts the checkpoint once with DeepSpeed's
    ds_to_universal into checkpoint-5.universal beside it (the user's folder unchanged) and resumes with
    load_universal: 2 ranks x batch 2 -> 1 rank x batch 2 x accumulation 2."""
    two, one = tmp_path / "two", tmp_path / "one"
    args = [*WORLD_ARGS, "--strategy", "zero2"]
    finetune(2, [*args, "--output_dir", str(two)], timeout=600)
    assert (two / "checkpoint-5" / "global_step5" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()
    shutil.copytree(two / "checkpoint-5", one / "checkpoint-5", symlinks=True)
    before = sorted(p.relative_to(one) for p in (one / "checkpoint-5").rglob("*"))
    # one rank still under torchrun: DeepSpeed reads its rank from the launcher's environment
    resumed = run(torchrun_command(1, str(FINETUNE), *TINY_ARGS, *args, "--gradient_accumulation_steps", "2",
                                   "--output_dir", str(one), "--resume_from_checkpoint", "latest"), timeout=600)
    assert resumed.returncode == 0, resumed.output[-6000:]
    universal = one / "checkpoint-5.universal"
    assert f"hftk: converted {one / 'checkpoint-5'} to DeepSpeed's universal checkpoint {universal}" \
        in resumed.stderr, resumed.stderr[-3000:]
    assert "(saved by 2 ranks, resumed on 1 with the same global batch" in resumed.stderr, resumed.stderr[-3000:]
    assert (universal / "latest_universal").read_text() == "global_step5_universal"
    assert sorted(p.relative_to(one) for p in (one / "checkpoint-5").rglob("*")) == before  # nothing added
    reference, after = losses(two), losses(one)
    assert sorted(after) == list(range(6, 11)), after
    # measured: losses equal bit for bit, weights 5.1e-7 apart (zero1 by hand: the same); 1e-5 as for ddp / fsdp:
    # fp32 with the gradient summed over two micro-batches on one rank instead of reduced over two ranks
    for step in range(6, 11):
        assert abs(after[step] - reference[step]) <= 1e-5, (step, reference[step], after[step])
    assert max_weight_diff(load_weights(two / "final"), load_weights(one / "final")) <= 1e-5

def sealed_by(folder, world: int, global_batch: int | None):
    """A sealed checkpoint folder as ``world`` ranks with ``global_batch`` would have left it."""
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text("{}")
    seal(folder, 5)
    marker = json.loads((folder / COMPLETE_MARKER).read_text())
    (folder / COMPLETE_MARKER).write_text(json.dumps({**marker, "world_size": world, "global_batch": global_batch}))
    return folder


@pytest.mark.parametrize("strategy, args, needle", [
    ("zero3_offload", [], "zero3_offload's per-rank checkpoint pieces cannot be split or joined across ranks. "
                          "Fix: resume with 2 ranks, or start a new run from its weights (`hftk export "
                          "CHECKPOINT OUT`"),
    ("zero3", [], "zero3's per-rank checkpoint pieces"),  # see OTHER_WORLD_SIZE_FIX in hftk/strategies/deepspeed.py
    ("zero2", [], "the global batch would be 2 instead of 4"),  # converted to a universal checkpoint: batch kept only
    ("pipeline", ["--pp_size", "2"], "pipeline's per-rank checkpoint pieces cannot be split or joined across ranks. "
                                     "Fix: resume with 2 ranks."),
    ("tp", [], "the global batch would be 2 instead of 4: the data position would not continue "
                               "where it stopped. Fix: keep its global batch of 4: --gradient_accumulation_steps 2"),
    ("sp", [], "the global batch would be 2 instead of 4"),
    ("ddp", ["--grad_compression", "fp16"], "per-rank gradient compression state cannot be split"),
    ("ddp", [], "the global batch would be 2 instead of 4: the data position would not continue where it stopped. "
                "Fix: keep its global batch of 4: --gradient_accumulation_steps 2 with --per_device_train_batch_size 2."),
    ("fsdp", [], "the global batch would be 2 instead of 4"),
])
def test_a_resume_at_another_world_size_that_would_not_be_exact_is_refused_in_one_line(strategy, args, needle,
                                                                                          tmp_path):
    folder = sealed_by(tmp_path / "run" / "checkpoint-5", world=2, global_batch=4)
    cfg = load_config([*TINY_ARGS, "--per_device_train_batch_size", "2", "--strategy", strategy, *args,
                       "--output_dir", str(tmp_path / "run")])
    with pytest.raises(HftkError) as caught:
        check_world_change(cfg, folder, world_size=1)
    line = caught.value.one_line()
    assert line.startswith(f"training.resume_from_checkpoint: {folder} was saved by 2 ranks; this launch has 1"), line
    assert needle in line, line


def test_a_resharding_resume_from_a_seal_without_a_global_batch_is_refused(tmp_path):
    folder = sealed_by(tmp_path / "run" / "checkpoint-5", world=2, global_batch=None)
    cfg = load_config([*TINY_ARGS, "--gradient_accumulation_steps", "2", "--output_dir", str(tmp_path / "run")])
    with pytest.raises(HftkError, match="its seal records no global batch to continue the data position from. "
                                        "Fix: resume with 2 ranks."):
        check_world_change(cfg, folder, world_size=1)


def test_a_resume_at_another_world_size_with_the_global_batch_kept_passes(tmp_path):
    folder = sealed_by(tmp_path / "run" / "checkpoint-5", world=2, global_batch=4)
    for strategy in ("ddp", "fsdp", "zero1", "zero2"):
        cfg = load_config([*TINY_ARGS, "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                           "--strategy", strategy, "--output_dir", str(tmp_path / "run")])
        check_world_change(cfg, folder, world_size=1)
    for strategy, sizes in (("tp", ["--tp_size", "2", "--dp_shard_size", "-1"]),  # 2 data-parallel ranks x 2
                            ("cp", ["--cp_size", "2", "--dp_replicate_size", "2"]), ("sp", ["--sp_size", "2"])):
        cfg = load_config([*TINY_ARGS, "--per_device_train_batch_size", "2", "--strategy", strategy, *sizes,
                           "--output_dir", str(tmp_path / "run")])
        check_world_change(cfg, folder, world_size=4)
    cfg = load_config([*TINY_ARGS, "--strategy", "zero2", "--output_dir", str(tmp_path / "run")])
    check_world_change(cfg, folder, world_size=2)  # the same world size: nothing to check


@pytest.mark.slow
def test_fsdp_saved_on_four_ranks_resumes_exactly_on_two_with_the_global_batch_kept(tmp_path):
    """DCP reshards the model and optimizer: 4 ranks x batch 1 -> 2 ranks x batch 1 x accumulation 2."""
    four, two = tmp_path / "four", tmp_path / "two"
    args = [*WORLD_ARGS, "--strategy", "fsdp", "--per_device_train_batch_size", "1"]
    finetune(4, [*args, "--output_dir", str(four)], timeout=600)
    assert (four / "checkpoint-5" / "fsdp_model" / "__3_0.distcp").is_file()  # four ranks' shards
    shutil.copytree(four / "checkpoint-5", two / "checkpoint-5")
    resumed = finetune(2, [*args, "--gradient_accumulation_steps", "2", "--output_dir", str(two),
                           "--resume_from_checkpoint", "latest"], timeout=400)
    assert "(saved by 4 ranks, resumed on 2 with the same global batch" in resumed.stderr, resumed.stderr[-3000:]
    reference, after = losses(four), losses(two)
    assert sorted(after) == list(range(6, 11)), after
    for step in range(6, 11):
        assert abs(after[step] - reference[step]) <= 1e-5, (step, reference[step], after[step])
    assert max_weight_diff(load_weights(four / "final"), load_weights(two / "final")) <= 1e-5


def test_only_a_zero_resume_at_another_world_size_loads_the_universal_folder(tmp_path, monkeypatch):
    """A checkpoint-5.universal left by an earlier 2 -> 1 resume must not be read by a resume at the saved
    world size (its DeepSpeed config then lacks load_universal), nor for a checkpoint that is not ZeRO's."""
    from hftk.strategies.deepspeed import resume_folder

    folder = sealed_by(tmp_path / "run" / "checkpoint-5", world=2, global_batch=4)
    (folder / "latest").write_text("global_step5")
    (folder / "global_step5").mkdir()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert resume_folder(str(folder)) == str(tmp_path / "run" / "checkpoint-5.universal")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resume_folder(str(folder)) == str(folder)
    (folder / "latest").unlink()  # not a DeepSpeed checkpoint (e.g. ddp's): nothing to convert
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert resume_folder(str(folder)) == str(folder)


def test_a_zero_checkpoint_deepspeed_cannot_convert_fails_in_one_line_and_leaves_nothing_beside_it(tmp_path):
    from hftk.strategies.deepspeed import to_universal

    folder = sealed_by(tmp_path / "run" / "checkpoint-5", world=2, global_batch=4)
    (folder / "latest").write_text("global_step5")
    (folder / "global_step5").mkdir()  # no ZeRO shards in it
    with pytest.raises(HftkError, match=rf"DeepSpeed could not convert {re.escape(str(folder))}/global_step5 to a "
                                        r"universal checkpoint: .* Fix: resume with the number of ranks that saved it"):
        to_universal(folder)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-5"]

def test_the_world_size_check_runs_before_any_process_group(tmp_path, monkeypatch):
    """``latest`` resolved and checked in ``prepare``: the refusal comes before the launch does anything."""
    import torch.distributed as dist

    from hftk.run import prepare

    sealed_by(tmp_path / "run" / "checkpoint-5", world=2, global_batch=4)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(HftkError, match=r"was saved by 2 ranks; this launch has 1, and the global batch would be 2"):
        prepare([*TINY_ARGS, "--per_device_train_batch_size", "2", "--output_dir", str(tmp_path / "run"),
                 "--resume_from_checkpoint", "latest"])
    assert not dist.is_initialized()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-5"]


def test_a_write_failure_inside_a_save_is_held_until_the_save_ends():
    """The writes after a failed one still run (a library's collectives between them stay matched)."""
    from hftk.checkpoint import held_until_settled, holding_write_failures

    done = []

    @held_until_settled
    def write(name: str) -> None:
        if name == "model":
            raise OSError(28, "No space left on device")
        done.append(name)

    with pytest.raises(OSError, match="No space left"), holding_write_failures():
        write("model")
        write("optimizer")  # reached: the failure is held
    assert done == ["optimizer"]
    with pytest.raises(OSError, match="No space left"):
        write("model")  # outside a save it raises at once
