"""A bad option under torchrun: the launcher prints the input error once, not once per rank."""

from __future__ import annotations

import pytest

from tests.helpers import FINETUNE, torchrun


@pytest.mark.slow
@pytest.mark.parametrize("args,named", [
    (["--strategy", "pipeline", "--pp_size", "3"], "strategy.pp_size"),
    (["--strategy", "zero2", "--grad_compression", "powersgd"], "grad_compression"),
])
def test_launcher_prints_an_input_error_once(args, named, tmp_path):
    """Under torchrun: rank 0's line is hftk's first output line, no rank prints it twice, every rank exits 2."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    result = torchrun(2, FINETUNE, ["--model_name_or_path", "builtin:gpt2-tiny", "--output_dir", str(out), *args],
                      timeout=240, real=True)  # the launcher's own summary is part of what the user sees
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("hftk")]
    assert len(ours) == 1 and ours[0].startswith("hftk: error: ") and named in ours[0], result.stderr[-3000:]
    before_launcher = result.stderr.split("ChildFailedError")[0]
    assert "Traceback" not in before_launcher.split(ours[0])[0], result.stderr[-3000:]
    codes = [line.split(":")[1].split()[0] for line in result.stderr.splitlines() if line.strip().startswith("exitcode")]
    assert codes and all(code in ("2", "-15") for code in codes) and "2" in codes, result.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
