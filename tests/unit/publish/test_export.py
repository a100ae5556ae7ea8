"""``hftk export`` refusals (hftk.publish.export): a run folder, a folder without weights, a non-empty target,
a merge of a full-model checkpoint, a base model without a merge."""

from __future__ import annotations

import pytest

from hftk.core.errors import HftkError


def test_export_refusals(tmp_path):
    from hftk.checkpoint.atomic import seal
    from hftk.publish.export import export

    run_dir = tmp_path / "run"
    (run_dir / "checkpoint-3").mkdir(parents=True)
    (run_dir / "checkpoint-3" / "trainer_state.json").write_text("{}")
    seal(run_dir / "checkpoint-3", 3)
    with pytest.raises(HftkError, match="run folder.*checkpoint-3"):
        export(run_dir, tmp_path / "a")
    with pytest.raises(HftkError, match="holds no weights hftk can read"):
        export(run_dir / "checkpoint-3", tmp_path / "b")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    with pytest.raises(HftkError, match="not empty"):
        export(run_dir / "checkpoint-3", tmp_path / "full")
    assert (tmp_path / "full" / "x").read_text() == "keep me"


def test_merge_of_a_full_model_checkpoint_is_refused(tmp_path):
    from hftk.core.errors import HftkError
    from hftk.publish.export import export

    (tmp_path / "checkpoint-1").mkdir()
    with pytest.raises(HftkError, match=r"--merge: .* holds no LoRA adapter"):
        export(tmp_path / "checkpoint-1", tmp_path / "out", merge=True)


def test_base_model_without_merge_is_one_clear_line(tmp_path, capsys):
    from hftk.cli import main

    assert main(["export", str(tmp_path), str(tmp_path / "out"), "--base_model", "gpt2"]) == 2
    err = capsys.readouterr().err
    assert err == "hftk: error: --base_model: only matters with --merge. Fix: add --merge, or drop --base_model.\n"
