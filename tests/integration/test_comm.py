"""Gradient compression over gloo: no hangs, replicas in sync, losses close to uncompressed,
bytes measured, hierarchical equals flat, gradient accumulation and exact resume through the Trainer."""

from __future__ import annotations

import json

import pytest
import torch

from hftk.comm.register import state_path
from tests.helpers import (FINETUNE, ROOT, finetune_cells, load_weights, losses, max_weight_diff, metrics, python,
                           torchrun)
from tests.netns import run_on_two_hosts

HOOKS = ("none", "fp16", "bf16", "powersgd", "topk")
TINY = {"model": "builtin:gpt2-tiny", "hooks": list(HOOKS), "block_size": 32, "batch": 4, "lr": 1e-3,
        "powersgd_warmup_steps": 10, "topk_warmup_steps": 10, "check_sync": True}
STEPS = 100


def _by(results, name):
    return {r["hook"]: r for r in results if r["name"] == name}


@pytest.fixture(scope="module")
def hook_runs(tmp_path_factory):
    """ONE 2-rank launch: every hook for 100 steps at bucket caps 25 (DDP's default) and 0.05 MB, and one step
    of each on a ~90M-parameter GPT-2 for the byte counts. gpt2-tiny has 1 MB of gradients: cap 25 gives one
    bucket (as cap 1 did, a run that computed exactly the same and is no longer repeated), 0.05 gives eight
    (the case that hangs torch's PowerSGD hook on gloo)."""
    from hftk.data.builtin import materialize_model

    materialize_model("builtin:gpt2-90m")
    root = tmp_path_factory.mktemp("comm")
    jobs = [{**TINY, "name": "cap25", "bucket_cap_mb": 25, "steps": STEPS},
            {**TINY, "name": "cap0.05", "bucket_cap_mb": 0.05, "steps": STEPS},
            {"name": "90m", "model": "builtin:gpt2-90m", "hooks": list(HOOKS), "steps": 1, "interleave": False,
             "powersgd_warmup_steps": 0, "topk_warmup_steps": 0, "optimizer": "sgd", "block_size": 16, "batch": 1,
             "eval_batches": 1, "check_sync": True}]
    (root / "plan.json").write_text(json.dumps({"jobs": jobs}))
    out = root / "results.json"
    result = torchrun(2, "hftk.bench.comm_worker", ["--plan", str(root / "plan.json"), "--out", str(out)],
                      timeout=600, extra=["-m"])
    assert result.returncode == 0, result.output[-5000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("cap", ["cap25", "cap0.05"])
def test_every_hook_keeps_replicas_identical_after_every_step(hook_runs, cap):
    runs = _by(hook_runs, cap)
    assert sorted(runs) == sorted(HOOKS)
    for hook, run_ in runs.items():
        assert run_["world_size"] == 2
        assert len(run_["records"]) == run_["steps"], hook
        assert all(r["in_sync"] for r in run_["records"]), hook
    buckets = [r["comm_buckets"] for r in runs["powersgd"]["records"][1:]]  # DDP's first backward: one bucket
    assert set(buckets) == ({8} if cap == "cap0.05" else {1})


@pytest.mark.slow
@pytest.mark.parametrize("cap", ["cap25", "cap0.05"])
def test_loss_after_100_steps_close_to_uncompressed(hook_runs, cap):
    runs = _by(hook_runs, cap)
    reference = runs["none"]["eval_loss"]
    assert reference < runs["none"]["records"][0]["loss"] - 1.0  # it learned
    tolerance = {"fp16": 0.005, "bf16": 0.005, "powersgd": 0.05, "topk": 0.05}
    for hook, tol in tolerance.items():
        assert runs[hook]["steps_run"] == STEPS
        assert abs(runs[hook]["eval_loss"] - reference) / reference <= tol, (hook, runs[hook]["eval_loss"], reference)
    # compression really happened after the warm-up
    assert runs["powersgd"]["records"][-1]["comm_compression_ratio"] > 5
    assert runs["topk"]["records"][-1]["comm_compression_ratio"] > 30


@pytest.mark.slow
def test_measured_bytes_on_90m_gpt2(hook_runs):
    runs = _by(hook_runs, "90m")
    params = runs["none"]["params"]
    assert 80e6 < params < 100e6
    sent = {hook: r["records"][0]["comm_bytes_per_step"] for hook, r in runs.items()}
    assert sent["none"] == 4 * params  # fp32 ring all-reduce on 2 ranks sends 2 (N-1)/N = 1x the gradient
    assert all(r["records"][0]["in_sync"] for r in runs.values())
    assert sent["none"] / sent["powersgd"] >= 50
    assert sent["none"] / sent["topk"] >= 30
    assert sent["none"] / sent["fp16"] == pytest.approx(2.0)
    assert sent["none"] / sent["bf16"] == pytest.approx(2.0)
    for hook, r in runs.items():
        ratio = r["records"][0]["comm_compression_ratio"]
        assert ratio == pytest.approx(sent["none"] / sent[hook]), hook


@pytest.fixture(scope="module")
def hierarchical(tmp_path_factory):
    out = tmp_path_factory.mktemp("hier") / "report.json"
    run_on_two_hosts(ROOT / "tests" / "workers" / "comm_hierarchical.py", ["--out", str(out)], nproc=2)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_hierarchical_topology_is_two_nodes_of_two(hierarchical):
    ranks = hierarchical["ranks"]
    assert hierarchical["world_size"] == 4
    assert [r["GROUP_RANK"] for r in ranks] == ["0", "0", "1", "1"]
    assert all(r["LOCAL_WORLD_SIZE"] == "2" and r["nodes"] == [[0, 1], [2, 3]] for r in ranks)
    assert [r["leader"] for r in ranks] == [True, False, True, False]


@pytest.mark.slow
def test_hierarchical_allreduce_equals_flat(hierarchical):
    for step in hierarchical["steps"]:
        assert all(v["same_on_all_ranks"] for k, v in step.items() if k != "ref_norm")
        plain = step["none/hier"]
        assert plain["max_diff_vs_torch_default"] <= 1e-6 * max(1.0, step["ref_norm"])
        assert plain["collectives"] == 3 * step["none/flat"]["collectives"]  # reduce, leaders' all-reduce, broadcast
        assert plain["inter_node_bytes"] > 0
        # under compression hooks: the same result as the same hook over one flat group
        assert step["fp16/hier"]["rel_diff_vs_flat_same_hook"] <= 2e-3  # fp16 partial sums round differently
        assert step["topk/hier"]["max_diff_vs_flat_same_hook"] == 0.0  # gathered in the same order, summed alike
        assert step["powersgd/hier"]["rel_diff_vs_flat_same_hook"] <= 1e-4
        assert step["powersgd/hier"]["inter_node_bytes"] < plain["inter_node_bytes"] / 5


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """The real Trainer path: PowerSGD over 13 buckets with gradient accumulation 2,
    checkpoint at step 4, then a resume from a copy of that checkpoint."""
    root = tmp_path_factory.mktemp("trainer")
    common = ["--max_steps", "8", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
              "--grad_compression", "powersgd", "--powersgd_warmup_steps", "2", "--check_sync_steps", "1",
              "--model_name_or_path", "builtin:gpt2-small", "--ddp_bucket_cap_mb", "1"]  # 15 MB of gradients
    finetune_cells(2, {"full": [*common, "--output_dir", str(root / "full"), "--save_strategy", "steps",
                                "--save_steps", "4"],
                       "resumed": [*common, "--output_dir", str(root / "resumed"), "--resume_from_checkpoint", "latest"]},
                   root, timeout=840,
                   options={"resumed": {"copy": [root / "full" / "checkpoint-4", root / "resumed" / "checkpoint-4"]}})
    return root


@pytest.mark.slow
def test_trainer_compresses_only_on_sync_steps(trainer_runs):
    logged = [m for m in metrics(trainer_runs / "full") if "comm_bytes_per_step" in m]
    assert [m["step"] for m in logged] == list(range(1, 9))
    assert logged[0]["comm_buckets"] == 1  # DDP's first backward runs one bucket; it rebuilds them afterwards
    for m in logged:
        assert m["step"] == 1 or m["comm_buckets"] >= 4
        # one hook call per bucket per optimizer step although each step ran two backward passes
        assert m["comm_hook_calls_per_step"] == m["comm_buckets"]
        if m["step"] <= 2:  # warm-up: one plain all-reduce per bucket
            assert m["comm_collectives_per_step"] == m["comm_buckets"] and m["comm_compression_ratio"] == 1.0
        else:  # P (with the uncompressed vectors) and Q all-reduces
            assert m["comm_buckets"] < m["comm_collectives_per_step"] <= 2 * m["comm_buckets"]
            assert m["comm_compression_ratio"] > 3
    sync = [m for m in metrics(trainer_runs / "full") if "ranks_in_sync" in m]
    assert len(sync) == 8 and all(m["ranks_in_sync"] for m in sync)


@pytest.mark.slow
def test_trainer_resume_with_compression_state_is_exact(trainer_runs):
    checkpoint = trainer_runs / "full" / "checkpoint-4"
    for rank in (0, 1):
        saved = torch.load(state_path(checkpoint, rank), weights_only=True)
        assert saved["kind"] == "powersgd" and saved["step"] == 4
        assert saved["q"] and any(t.abs().sum() > 0 for t in saved["error"].values())
    full, resumed = losses(trainer_runs / "full"), losses(trainer_runs / "resumed")
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in resumed:
        assert resumed[step] == pytest.approx(full[step], abs=1e-6), step
    assert max_weight_diff(load_weights(trainer_runs / "full" / "final"),
                           load_weights(trainer_runs / "resumed" / "final")) < 1e-6


def test_cli_prints_one_line_and_exits_2(tmp_path):
    out = tmp_path / "out"
    result = python([str(FINETUNE), "--output_dir", str(out), "--grad_compression", "topk",
                  "--strategy", "zero2"], timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip() and "Setting accelerator" not in line]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("hftk: error: strategy.grad_compression") and "Fix:" in lines[0]
    assert not out.exists()
