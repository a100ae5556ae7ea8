"""The memory bench's loss rows (hftk/bench/loss.py): a cell the plan puts above the free memory is not run and says
why; the loss's bytes are net of the small-vocabulary twin; the ratios are chunked over plain."""

from __future__ import annotations

import json
from types import SimpleNamespace

from hftk.bench import loss as loss_bench
from hftk.plan.estimate import GIB, MIB


def test_rows_ratios_and_a_cell_too_big_for_this_machine(tmp_path, monkeypatch):
    peaks = {"baseline": 1000, "plain": 9000, "chunked": 1500}  # MiB; model state 100 / 400 / 400

    def launch(nproc, module, args, work, timeout, threads):
        name = work.name.rsplit("-", 1)[1]
        (work / "run").mkdir(parents=True)
        state = 100 if name == "baseline" else 400
        (work / "memory.json").write_text(json.dumps({"ranks": [{"peak": peaks[name] * MIB, "total": state * MIB}]}))
        return SimpleNamespace(wall_s=1.0)

    monkeypatch.setattr(loss_bench, "make_model", lambda folder, vocab, tokens: folder)
    monkeypatch.setattr(loss_bench, "torchrun_module", launch)
    monkeypatch.setattr(loss_bench, "free_bytes", lambda: 10 * GIB)
    plans = {"512": 1 * GIB, "4096": 20 * GIB}  # the plain cell at 4096 tokens does not fit 10 GiB

    def predict(args, nproc, strategies):
        tokens = args[args.index("--block_size") + 1]
        big = tokens == "4096" and "plain" in args
        return {"ddp": SimpleNamespace(device_total=plans["4096"] if big else plans["512"])}

    result = loss_bench.run_loss_rows(tmp_path, [], 151936, (512, 4096), 3, 60, predict, lambda path: 2.0)
    small = result["cells"]["512"]
    assert small["plain"]["loss_mib"] == (9000 - 400) - (1000 - 100)
    assert small["chunked"]["loss_vs_plain"] == (1500 - 400 - 900) / (9000 - 400 - 900)
    assert small["chunked"]["step_time_vs_plain"] == 1.0
    big = result["cells"]["4096"]
    assert "20.0 GiB" in big["plain"]["skipped"] and "loss_vs_plain" not in big["chunked"]
    assert result["targets"] == {}  # the longest length could not be compared: no verdict
    text = "\n".join(loss_bench.markdown_rows(result))
    assert "| 4096 | plain | not run: the plan puts it at 20.0 GiB" in text and "| 512 | chunked | 1500 |" in text
