"""``hftk bench batch`` when one rank runs out of device memory: the search ends there, the trials
left run in a new launch, and no rank waits in a collective its peer never joins."""

from __future__ import annotations

import os

import pytest

from hftk.bench.batch import run_batch_bench
from tests.helpers import ROOT, require_ranks

INJECT = ROOT / "tests" / "inject_oom"


@pytest.mark.slow
def test_an_out_of_memory_rank_ends_its_launch_and_the_pairs_left_run_in_a_new_one(tmp_path, monkeypatch):
    require_ranks(2)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(INJECT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("HFTK_TEST_OOM_MICRO_BATCH", "2")
    result = run_batch_bench(tmp_path, nproc=2, model="builtin:gpt2-tiny", block_size=32, budget_gb=8,
                             max_micro_batch=4, global_batch=4, warmup=1, steps=1, timeout=300)
    ddp = result["strategies"]["ddp"]
    ran = [(t["kind"], t["micro_batch"], t["accumulation"], t["oom"]) for t in ddp["trials"]]
    assert ran == [("search", 1, 1, False), ("search", 2, 1, True), ("pair", 1, 2, False)], ran
    assert ddp["largest_micro_batch"] == 1 and ddp["budget_hit"]
    assert (ddp["best_pair"]["micro_batch"], ddp["best_pair"]["accumulation"]) == (1, 2)
    assert ddp["best_pair"]["samples_per_s"] > 0 and (tmp_path / "ddp" / "after_oom1" / "ranks").is_dir()
    assert result["table"]["rows"][0][1] == "1"
