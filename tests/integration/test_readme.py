"""The README's main command, as written (output folder aside): 2 processes, loss falls, checkpoint + metrics."""

from __future__ import annotations

import re
import shlex

import pytest

from tests.helpers import ROOT, metrics, noise_in, run
from tests.unit.test_readme import readme_commands

pytestmark = pytest.mark.slow


def test_readme_main_command_trains_two_ranks(tmp_path):
    main, _ = readme_commands()
    argv = shlex.split(main.split(" && ", 1)[1])
    argv[argv.index("--output_dir") + 1] = str(tmp_path / "default")
    argv[0] = str(ROOT / argv[0])  # .venv/bin/accelerate
    result = run(argv, timeout=600)
    assert result.returncode == 0, result.output[-5000:]
    # the profiled steps (3 and every 50th) leave no libkineto marker lines between the progress updates
    assert "profiler_start" not in result.output and "profiler_stop" not in result.output
    assert not noise_in(result.output), noise_in(result.output)  # nor the libraries' notices (hftk.core.output)
    last = result.stderr.strip().splitlines()[-1]  # what was made, and what a rerun does
    assert re.match(r"hftk: done: step \d+ in \d+ s, eval loss [\d.]+, perplexity [\d.]+; the model is in "
                    rf"{re.escape(str(tmp_path / 'default' / 'final'))} \(rerunning this command resumes from "
                    r"checkpoint-\d+\)$", last), last
    out = tmp_path / "default"
    logged = metrics(out)
    train_losses = [m["loss"] for m in logged if "loss" in m]
    assert train_losses[-1] < train_losses[0] - 1.0  # it learns the corpus
    assert any("eval_perplexity" in m for m in logged)
    assert sorted(out.glob("checkpoint-*")) and (out / "final" / "model.safetensors").exists()
    # two ranks really split the data: 2 epochs took blocks / (2 ranks x 8) steps each
    from hftk.config.options import load_config
    from hftk.data.dataset import check_raw, load_raw, tokenize_and_pack
    from hftk.models.loading import load_tokenizer
    from hftk.run.validate import resolve_packing

    cfg = load_config([])
    raw = load_raw(cfg.data)
    resolve_packing(cfg, check_raw(cfg.data, raw))
    blocks = len(tokenize_and_pack(cfg.data, raw, load_tokenizer(cfg.model), check_raw(cfg.data, raw), 42).train)
    final_step = max(m["step"] for m in logged)
    assert final_step == 2 * -(-blocks // 16), (final_step, blocks)
