"""The checkpoint layer (hftk.checkpoint.atomic) in one process: the RNG state every loop without the Trainer
saves and restores (python, numpy, torch CPU and CUDA when present), the seal check of an explicit
resume, and write failures inside a save (a full disk named even when torch hides the errno, other
failures raised as they are, a failure held until the save ends)."""

from __future__ import annotations

import random
import resource
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from hftk.checkpoint.atomic import RNG_FILE, STAGING_DIR, list_checkpoints, load_rng, save_rng, seal, staged_folder
from hftk.core.errors import HftkError
from tests.unit.run.test_validate import attempt


def _draws() -> tuple:
    cuda = torch.cuda.random.get_rng_state_all() if torch.cuda.is_available() else None
    if cuda is not None:
        torch.cuda.random.manual_seed_all(random.randrange(2**31))  # moves the CUDA generators too
    return (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist(),
            torch.nn.functional.dropout(torch.ones(16), 0.5).tolist(), cuda and [s.tolist() for s in cuda])


def test_load_rng_continues_every_generator_exactly(tmp_path):
    save_rng(tmp_path)
    assert torch.load(tmp_path / RNG_FILE.format(0), weights_only=True)  # loads without pickled objects
    first = _draws()
    assert _draws() != first
    assert load_rng(tmp_path)
    assert _draws() == first


def test_a_rank_without_a_saved_state_keeps_its_generators(tmp_path):
    before = torch.random.get_rng_state()
    assert not load_rng(tmp_path)
    assert torch.equal(torch.random.get_rng_state(), before)


def _sealed_checkpoint(folder: Path) -> Path:
    """A checkpoint folder as hftk publishes it: a weights file, trainer state, the seal last."""
    import torch
    from safetensors.torch import save_file

    from hftk.checkpoint.atomic import seal

    folder.mkdir(parents=True)
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(folder / "model.safetensors"))
    (folder / "trainer_state.json").write_text("{}")
    seal(folder, step=3)
    return folder


@pytest.mark.parametrize("damage,named", [
    ("unsealed", "hftk_complete.json"),
    ("truncated", "model.safetensors"),
    ("header", "model.safetensors"),
    ("missing", "trainer_state.json"),
])
def test_explicit_resume_is_checked_like_latest(damage, named, tmp_path, capsys):
    """``--resume_from_checkpoint PATH``: the seal and the file headers are checked before launch, the file named."""
    ckpt = _sealed_checkpoint(tmp_path / "old" / "checkpoint-3")
    weights = ckpt / "model.safetensors"
    if damage == "unsealed":
        (ckpt / "hftk_complete.json").unlink()
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-10])
    elif damage == "header":  # same size, header bytes overwritten: only reading the header finds it
        data = bytearray(weights.read_bytes())
        data[8:20] = b"\xff" * 12
        weights.write_bytes(bytes(data))
    else:
        (ckpt / "trainer_state.json").unlink()
    argv = ["--model_name_or_path", "builtin:gpt2-tiny", "--output_dir", str(tmp_path / "out"), "--report_to", "none",
            "--resume_from_checkpoint", str(ckpt)]
    assert attempt(argv, tokenize=False) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("hftk: error: training.resume_from_checkpoint") and named in line, line
    assert "\n" not in line


def test_an_intact_explicit_checkpoint_passes_the_check(tmp_path):
    from hftk.checkpoint.atomic import check_resumable

    check_resumable(_sealed_checkpoint(tmp_path / "checkpoint-3"))  # raises on any problem


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


def test_a_failure_that_is_not_a_full_disk_is_one_line_with_its_traceback_printed(tmp_path, capsys):
    """A bug in a save: one line naming it (what every rank reports), its stack printed where it happened."""
    final = tmp_path / "final"
    final.mkdir()
    (final / "model.safetensors").write_bytes(b"the previous weights")
    with pytest.raises(HftkError) as caught, staged_folder(final, publisher=True):
        raise ValueError("a bug")
    assert caught.value.one_line().startswith(
        f"training.output_dir: saving {final} failed: ValueError: a bug ({final} keeps its previous content).")
    err = capsys.readouterr().err
    assert "Traceback" in err and 'raise ValueError("a bug")' in err
    assert not (tmp_path / STAGING_DIR).exists() and (final / "model.safetensors").read_bytes() == b"the previous weights"


def test_an_hftk_error_in_a_save_keeps_its_field_and_fix(tmp_path):
    with pytest.raises(HftkError) as caught, staged_folder(tmp_path / "checkpoint-2", publisher=True):
        raise HftkError("output", "the folder lacks x.", "gather first.")
    assert caught.value.one_line() == (f"output: saving {tmp_path / 'checkpoint-2'} failed: the folder lacks x. (no "
                                       "earlier checkpoint exists) Fix: gather first.")


def test_a_write_failure_inside_a_save_is_held_until_the_save_ends():
    """The writes after a failed one still run (a library's collectives between them stay matched)."""
    from hftk.checkpoint.atomic import held_until_settled, holding_write_failures

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
