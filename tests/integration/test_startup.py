"""Start-up as a user pays it: the heavy packages a plain ddp text run has imported by its first optimizer
step, in a real launch (fresh interpreters, not warm ranks), so a new top-level import cannot bring one back
unnoticed; and the run's own ``startup`` record of where the seconds went."""

from __future__ import annotations

import json

import pytest

from hftk.core.startup import PHASES
from tests.helpers import ROOT, TINY_ARGS, metrics, run, torchrun_command

pytestmark = pytest.mark.slow
PROBE = ROOT / "tests" / "workers" / "first_step_modules.py"
# Never needed by a ddp text run without trackers: hftk must not import them (of trl only its ``pad``). What
# the libraries import themselves stays, as a plain Trainer script pays it too (``hftk bench startup``'s
# reference): transformers.trainer_utils imports peft whenever it is installed, peft imports bitsandbytes
# (whose kernels are wrapped in torch.compile at import: inductor), transformers' generation utilities import
# deepspeed when it is installed, datasets imports pandas.
NOT_USED = {"wandb", "tensorboard", "matplotlib", "mpi4py", "torchvision"}


def test_a_plain_ddp_text_run_imports_no_package_it_does_not_use(tmp_path):
    out = tmp_path / "modules.json"
    cmd = torchrun_command(2, str(PROBE), *TINY_ARGS, "--max_steps", "2", "--output_dir", str(tmp_path / "run"))
    result = run(cmd, timeout=300, env={"HFTK_MODULES_OUT": str(out)})
    assert result.returncode == 0, result.output[-4000:]
    modules = json.loads(out.read_text())
    packages = {name.split(".")[0] for name in modules}
    assert not packages & NOT_USED, sorted(packages & NOT_USED)
    assert "trl.trainer.sft_trainer" not in modules  # TRL's collator module (and its trainer base) stay out
    # the run's own account of its start-up: every phase, adding up to its total
    record = next(m["startup"] for m in metrics(tmp_path / "run") if "startup" in m)
    assert set(record) == {*PHASES, "total"}
    assert sum(v for k, v in record.items() if k != "total") == pytest.approx(record["total"], abs=0.01)
    assert record["imports"] > 1.0  # a fresh interpreter: torch and transformers were imported here
    assert "hftk: first optimizer step" in result.stdout
