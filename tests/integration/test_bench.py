"""``hftk bench all``, reduced (tiny model, few steps, one repeat), end to end through the CLI:
one report folder with results.json, summary.md and every chart, every figure a finite measured
number, every bench run monitored on every rank."""

from __future__ import annotations

import json
import sys

import pytest

from hftk.bench.cli import BENCHES, available
from hftk.bench.launch import LAUNCHER_ENV, threads_per_rank
from hftk.bench.report import numeric_leaves, unmeasured
from hftk.bench.startup import PHASES as STARTUP_PHASES
from tests import warm
from tests.helpers import ROOT, python, require_ranks
from tests.warm_torchrun import SOCKET_ENV

REDUCED = [
    "--model", "builtin:gpt2-tiny", "--block_size", "64", "--nproc", "2",
    "--set", "scaling.micro_batch=4", "--set", "scaling.warmup=3", "--set", "scaling.steps=4",
    "--set", "scaling.repeats=1", "--set", "scaling.target_loss=7.6",
    "--set", "overhead.micro_batch=4", "--set", "overhead.warmup=3", "--set", "overhead.steps=4",
    "--set", "overhead.repeats=1",
    "--set", "batch.max_micro_batch=4", "--set", "batch.global_batch=8", "--set", "batch.budget_gb=8",
    "--set", "batch.steps=1",
    "--set", "comm.steps=6", "--set", "comm.warmup_steps=2", "--set", "comm.micro_batch=4",
    "--set", "pipeline.steps=2", "--set", "pipeline.warmup=1", "--set", "pipeline.microbatches=2,4",
    "--set", "pipeline.n_layer=4", "--set", "pipeline.n_embd=64",
    "--set", "memory.steps=2", "--set", "memory.strategies=ddp,fsdp", "--set", "memory.dpo=true",
    "--set", "data.examples=40", "--set", "data.min_words=4", "--set", "data.max_words=40",
    "--set", "startup.nprocs=2", "--set", "startup.repeats=1",
    "--set", "moe.model=builtin:qwen3-moe-small", "--set", "moe.steps=2", "--set", "moe.micro_batch=2",
    "--set", "moe.implementations=eager",
]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    require_ranks(2)  # --nproc 2
    out = tmp_path_factory.mktemp("bench") / "report"
    # the benches' ranks on warm ranks (tests/warm_torchrun.py), forked from a server with the environment
    # bench launches give them; the startup bench keeps torchrun, whose start-up it measures
    ranks = warm.server_for(warm.cell_env({"OMP_NUM_THREADS": str(threads_per_rank(2)), "TOKENIZERS_PARALLELISM": "false"}))
    launcher = {LAUNCHER_ENV: f"{sys.executable} {ROOT / 'tests' / 'warm_torchrun.py'}", SOCKET_ENV: ranks.path}
    ranks.wait_ready()
    result = python(["-m", "hftk.cli", "bench", "all", "--out", str(out), *REDUCED], timeout=900, env=launcher)
    return out, result


@pytest.mark.slow
def test_every_bench_ran(report):
    out, result = report
    assert set(available()) == set(BENCHES), f"missing bench modules: {set(BENCHES) - set(available())}"
    assert result.returncode == 0, result.output[-6000:]
    payload = json.loads((out / "results.json").read_text())
    assert list(payload["benches"]) == list(BENCHES) and payload["failures"] == {}


@pytest.mark.slow
def test_report_structure_and_charts(report):
    out, _ = report
    payload = json.loads((out / "results.json").read_text())
    summary = (out / "summary.md").read_text()
    meta = payload["meta"]
    assert len(meta["loadavg_start"]) == 3 and meta["cpu_count"] >= 1 and meta["duration_s"] > 0
    for name, result in payload["benches"].items():
        assert f"## {name}" in summary
        assert result["table"]["rows"] and result["table"]["title"] in summary
        assert result["charts"], name
        for chart in result["charts"]:
            png = out / name / chart
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 300_000, png
            assert f"({name}/{chart})" in summary


@pytest.mark.slow
def test_every_figure_is_a_finite_measured_number(report):
    out, _ = report
    benches = json.loads((out / "results.json").read_text())["benches"]
    assert unmeasured(benches) == []
    assert len(numeric_leaves(benches)) > 50
    scaling = benches["scaling"]["by_nproc"]
    assert set(scaling) == {"1", "2"}
    # efficiency and the overhead ratios recomputed from each run's own step times (one repeat each)
    run = {r["nproc"]: r for r in benches["scaling"]["runs"]}
    micro_batch = benches["scaling"]["micro_batch_per_rank"]
    for n in (1, 2):
        assert run[n]["samples_per_s"] == pytest.approx(n * micro_batch / run[n]["step_time_s"], rel=1e-9)
    assert scaling["1"]["efficiency"]["median"] == 1.0
    assert scaling["2"]["efficiency"]["median"] == pytest.approx(
        run[2]["samples_per_s"] / (2 * run[1]["samples_per_s"]), rel=1e-9)
    assert scaling["2"]["cpu_efficiency"]["median"] == pytest.approx(run[1]["cpu_time_s"] / run[2]["cpu_time_s"], rel=1e-9)
    assert all(s["target_reached"] == "1/1" for s in scaling.values())
    overhead = benches["overhead"]
    variant = {r["variant"]: r for r in overhead["runs"]}
    assert overhead["throughput_ratio"]["median"] == pytest.approx(
        variant["hand"]["step_time_s"] / variant["hftk"]["step_time_s"], rel=1e-9)
    assert overhead["cpu_ratio"]["median"] == pytest.approx(
        variant["hand"]["cpu_time_s"] / variant["hftk"]["cpu_time_s"], rel=1e-9)
    memory = benches["memory"]["strategies"]
    for strategy in ("ddp", "fsdp"):  # DPO rows: the reference counted as the plan has it, the peak against SFT's
        dpo = memory[f"{strategy} dpo"]
        assert dpo["reference_mib"] == pytest.approx(dpo["plan_reference_mib"], rel=0.05) and dpo["reference_mib"] > 0
        assert dpo["peak_vs_sft"] == pytest.approx(dpo["peak_mib"] / memory[strategy]["peak_mib"], rel=1e-9)
        assert dpo["step_time_vs_sft"] == pytest.approx(dpo["step_time_s"] / memory[strategy]["step_time_s"], rel=1e-9)
        assert dpo["step_time_vs_sft"] > 1  # chosen and rejected through the policy, and the reference's forward
        assert memory[strategy]["reference_mib"] == memory[strategy]["plan_reference_mib"] == 0
    assert memory["fsdp dpo"]["reference_mib"] < 0.6 * memory["ddp dpo"]["reference_mib"]  # sharded over 2 ranks
    batch = benches["batch"]["strategies"]["ddp"]
    assert batch["largest_micro_batch"] == 4 and batch["best_pair"]["micro_batch"] * batch["best_pair"]["accumulation"] == 4
    data = benches["data"]["modes"]
    assert data["bfd"]["padding_share"] < data["none"]["padding_share"] < data["pad-to-block"]["padding_share"]
    assert data["none"]["eval_loss"] == pytest.approx(data["pad-to-block"]["eval_loss"], abs=1e-5)  # padding is exact
    moe = benches["moe"]["rows"]  # ddp, fsdp and ep at the device's experts implementation (grouped_mm), ep eager
    assert list(moe) == ["ddp", "fsdp", "ep", "ep eager"]
    for row in moe.values():
        assert row["tokens_per_s_vs_ddp"] == pytest.approx(row["tokens_per_s"] / moe["ddp"]["tokens_per_s"], rel=1e-9)
        assert row["tokens_per_s"] == pytest.approx(2 * 2 * 64 / row["step_time_s"], rel=1e-9)
    assert moe["ep"]["all_to_all_bytes_per_step"] > 0 and "all_to_all_bytes_per_step" not in moe["fsdp"]
    assert moe["ep"]["model_state_mib"] < 0.6 * moe["ddp"]["model_state_mib"]  # experts and dense parts sharded
    startup = benches["startup"]
    timed = {r["variant"]: r["seconds"] for r in startup["runs"]}
    assert set(timed["hftk"]) == {*STARTUP_PHASES, "total"}  # every phase hftk marks, from its own record
    assert set(timed["plain"]) == {*STARTUP_PHASES, "total"} - {"prepare"}  # the plain script validates nothing
    for seconds in timed.values():  # phases add up to the time from process start to the first step
        assert sum(v for k, v in seconds.items() if k != "total") == pytest.approx(seconds["total"], abs=0.01)
    assert startup["by_nproc"]["2"]["ratio"]["median"] == pytest.approx(
        timed["hftk"]["total"] / timed["plain"]["total"], rel=1e-9)


@pytest.mark.slow
def test_bench_runs_are_monitored_on_every_rank(report):
    """The scaling bench trains through hftk's engine: the rank monitor logged both ranks' stats."""
    out, _ = report
    records = [json.loads(line) for path in out.glob("scaling/n2-*/run/metrics.jsonl")
               for line in path.read_text().splitlines() if "rank_stats" in line]
    assert records and all(len(r["rank_stats"]["compute_time_s"]) == 2 for r in records)
    for r in records:  # per rank: compute is part of its step; its counted tensors are resident in its peak
        stats = r["rank_stats"]
        if r["step"] == 1:  # a window of only the process's first step (one-time work) has no compute verdict
            assert stats["compute_time_s"] == [None, None] and r["rank_wait_share"] is None, r
            continue
        assert all(c <= s for c, s in zip(stats["compute_time_s"], stats["step_time_s"])), r
        assert all(p >= t for p, t in zip(stats["peak_mem_mb"], stats["tensor_mb"])), r
