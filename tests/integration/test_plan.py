"""The memory plan against real runs: each rank's model state within 5% of the plan (2 ranks, every
strategy, launched through its generated YAML), and ``auto``'s budget holds without any allocator setting."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hftk.core import allocator
from hftk.data.builtin import builtin_model_config
from hftk.plan.estimate import GIB, HEADROOM, MIB, PLAN_STRATEGIES, PlanInputs, estimate, model_shape, plan
from tests.helpers import FINETUNE, ROOT, finetune_cells, free_port, metrics, preference_pairs, run, torchrun

ACCELERATE = Path(sys.executable).with_name("accelerate")
MICRO_BATCH = 4
TOLERANCE = 0.05


# ---- plan accuracy: every strategy, 2 ranks, launched through its generated YAML ----

@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """`accelerate launch` of each strategy's YAML starts tests/workers/launch_probe.py: 2 real ranks report the
    strategy hftk reads and hand back the ACCELERATE_* / FSDP_* variables the launch set. Returns, per strategy,
    the probes and those variables (the measured runs replay them on warm ranks)."""
    root = tmp_path_factory.mktemp("launched")
    result = {}
    for strategy in PLAN_STRATEGIES:
        env_out = root / f"{strategy}.env.json"
        cmd = [str(ACCELERATE), "launch", "--config_file", f"accelerate_configs/{strategy}.yaml",
               "--main_process_port", str(free_port()), str(ROOT / "tests" / "workers" / "launch_probe.py"), str(env_out)]
        launch = run(cmd, timeout=300)
        assert launch.returncode == 0, f"{strategy}:\n{launch.output[-5000:]}"
        probes = [json.loads(line[len("PROBE "):]) for line in launch.stdout.splitlines() if line.startswith("PROBE ")]
        result[strategy] = probes, json.loads(env_out.read_text())
    return result


@pytest.fixture(scope="module")
def measured(tmp_path_factory, launched):
    """One short run per strategy (2 optimizer steps, 2 ranks), each with what accelerate_configs/<s>.yaml
    launches (its variables, :func:`launched`; ``finetune_cells`` on warm ranks); ddp's through
    `--strategy auto`, which must pick it for the tiny model."""
    root = tmp_path_factory.mktemp("plan")
    options, cells = {}, {}
    for strategy in PLAN_STRATEGIES:
        options[strategy] = {"env": launched[strategy][1], "memory_out": root / f"{strategy}.json"}
        cells[strategy] = ["--max_steps", "2", "--per_device_train_batch_size", str(MICRO_BATCH),
                           "--comm_profile_steps", "0", "--output_dir", str(root / strategy),
                           *(["--strategy", "auto"] if strategy == "ddp" else [])]
    outputs = finetune_cells(2, cells, root, options=options)
    return {s: (json.loads((root / f"{s}.json").read_text()), outputs[s], launched[s][0]) for s in PLAN_STRATEGIES}


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first one launches every strategy
@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_plan_predicts_each_ranks_model_state_within_5_percent(measured, tiny_shape, strategy):
    record, stdout, probes = measured[strategy]
    # the YAML's real launch: 2 ranks, each reading the YAML's strategy (ddp's says none: auto decides)
    assert sorted(p["rank"] for p in probes) == [0, 1] and all(p["world"] == 2 and p["sum"] == 2 for p in probes)
    assert all(p["strategy"] == (None if strategy == "ddp" else strategy) for p in probes), probes
    assert record["strategy"] == strategy and record["world_size"] == 2  # the YAML chose it, 2 real ranks
    expected = "hftk: strategy auto -> ddp" if strategy == "ddp" else f"hftk: strategy {strategy} from the launch"
    assert expected in stdout
    predicted = estimate(strategy, tiny_shape, PlanInputs(world_size=2, device_memory_bytes=GIB, seq_len=64,
                                                          micro_batch=MICRO_BATCH, device="cpu"))
    for rank, counted in enumerate(record["ranks"]):
        error = predicted.model_state / counted["total"] - 1
        assert abs(error) <= TOLERANCE, (strategy, rank, predicted.to_dict(), counted)


# ---- auto's budget holds as a user launches: no allocator variables, default telemetry ----

@pytest.mark.slow
def test_auto_budget_holds_without_any_allocator_setting(tmp_path, monkeypatch):
    """gpt2-90m on 2 gloo ranks under a budget only a sharded strategy fits: every rank's measured
    training-phase peak RSS stays under it. The test sets no MALLOC_* variable (hftk.core.allocator tunes
    glibc itself; with glibc's defaults FSDP's peak was twice the plan's). The same run shows the
    evaluation line: blocks capped by data.max_eval_samples, batches per rank."""
    for name in [*allocator.SETTINGS, "GLIBC_TUNABLES"]:
        monkeypatch.delenv(name, raising=False)
    shape = model_shape(builtin_model_config("builtin:gpt2-90m"))
    inputs = PlanInputs(world_size=2, device_memory_bytes=GIB, seq_len=32, micro_batch=1, device="cpu")
    plans = {p.strategy: p for p in plan(shape, inputs)}
    budget = plans["fsdp"].device_total / (1 - HEADROOM) * 1.01
    usable = budget * (1 - HEADROOM)
    assert plans["ddp"].device_total > usable and plans["zero2"].device_total > usable  # only sharding fits
    out = tmp_path / "out"
    launch = torchrun(2, FINETUNE, [
        "--model_name_or_path", "builtin:gpt2-90m", "--block_size", "32", "--per_device_train_batch_size", "1",
        "--max_steps", "4", "--max_train_samples", "400", "--eval_fraction", "0.1", "--max_eval_samples", "6",
        "--per_device_eval_batch_size", "2", "--eval_strategy", "no", "--save_strategy", "no", "--report_to", "none",
        "--logging_steps", "1", "--disable_tqdm", "true", "--strategy", "auto",
        "--device_memory_gb", f"{budget / GIB:.4f}", "--output_dir", str(out)], timeout=900)
    assert launch.returncode == 0, launch.output[-5000:]
    assert "hftk: strategy auto -> fsdp (" in launch.stdout
    assert launch.stdout.count("hftk: evaluation: 6 blocks of 32 tokens, 2 batches of 2 per rank over 2 "
                               "data-parallel rank(s) per evaluation (capped by data.max_eval_samples=6)") == 1
    windows = [m for m in metrics(out) if "rank_stats" in m]
    assert len(windows) == 4 and all(m["peak_mem_kind"] == "rss_hwm" for m in windows)
    peaks = [max(m["rank_stats"]["peak_mem_mb"][rank] for m in windows) * MIB for rank in range(2)]
    assert all(peak < budget for peak in peaks), (f"peak RSS per rank {[round(p / MIB) for p in peaks]} MiB, budget "
                                                 f"{budget / MIB:.0f} MiB, plan {plans['fsdp'].device_total / MIB:.0f}")


# ---- DPO: the reference model as each strategy holds it, counted on every rank ----

DPO_STRATEGIES = ("ddp", "zero2", "fsdp", "zero3")


@pytest.fixture(scope="module")
def dpo_measured(tmp_path_factory, launched):
    """One short DPO run per strategy through the memory worker (2 warm ranks), which counts the reference's
    local bytes beside the policy's model state; each as its YAML launches it (the launch's variables name the
    strategy: no --strategy but ddp's, whose YAML names none)."""
    root = tmp_path_factory.mktemp("plan_dpo")
    data = preference_pairs(root / "prefs.jsonl", 30, 0)
    cells = {s: ["--method", "dpo", "--dataset", str(data), *(["--strategy", "ddp"] if s == "ddp" else []),
                 "--max_steps", "2", "--eval_fraction", "0", "--per_device_train_batch_size", str(MICRO_BATCH),
                 "--comm_profile_steps", "0", "--output_dir", str(root / s)] for s in DPO_STRATEGIES}
    outputs = finetune_cells(2, cells, root, options={s: {"env": launched[s][1], "memory_out": root / f"{s}.json"}
                                                      for s in DPO_STRATEGIES})
    for s in DPO_STRATEGIES:
        assert s == "ddp" or f"hftk: strategy {s} from the launch" in outputs[s], outputs[s][-3000:]
    return {s: json.loads((root / f"{s}.json").read_text()) for s in DPO_STRATEGIES}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", DPO_STRATEGIES)
def test_plan_predicts_the_dpo_reference_each_rank_holds(dpo_measured, tiny_shape, strategy):
    """Whole under ddp and ZeRO-2 (TRL's stage-0 DeepSpeed engine), sharded under fsdp and ZeRO-3: the counted
    bytes equal the plan's reference row within 5%, and the policy's model state is still the SFT plan's."""
    predicted = estimate(strategy, tiny_shape, PlanInputs(world_size=2, device_memory_bytes=GIB, seq_len=64,
                                                          micro_batch=MICRO_BATCH, device="cpu", pairs=True,
                                                          reference=True))
    record = dpo_measured[strategy]
    assert record["strategy"] == strategy and record["world_size"] == 2
    for rank, counted in enumerate(record["ranks"]):
        assert counted["reference"] > 0, (strategy, rank)
        assert abs(predicted.reference / counted["reference"] - 1) <= TOLERANCE, (strategy, rank, predicted.reference,
                                                                                 counted["reference"])
        assert abs(predicted.model_state / counted["total"] - 1) <= TOLERANCE, (strategy, rank, counted)
