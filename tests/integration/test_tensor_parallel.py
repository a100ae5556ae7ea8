"""Tensor, context and sequence parallel over gloo: real sharding, parity with one process, exact resume, export.

Every multi-process configuration runs once (module-scoped fixtures). References: GPT-2's is a plain
PyTorch loop on one process (tests/reference/plain.py: no hftk, torch's AdamW as the mesh loop builds
it, the mean loss over every predicted token); Llama's is the mesh loop at degree 1 on one process
(its checkpoint and memory counts serve the export and memory tests), itself checked against the
plain loop. The in-process checks (plans, shards, loop rules, refusals) are in tests/unit/strategies/
(test_tp_plans.py, test_context.py, test_mesh.py), tests/unit/engine/test_loop.py and tests/unit/plan/test_estimate.py.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.faults import hub_env
from tests.helpers import (ROOT, TINY_ARGS, finetune, greedy_ids, hftk_greedy_ids, load_weights, losses, max_weight_diff,
                           metrics, plain_reference, torchrun, wandb_run)

STEPS = 5
TOL = 1e-5
LLAMA = ["--model_name_or_path", "builtin:llama-tiny"]
GPT2 = ["--model_name_or_path", "builtin:gpt2-tiny"]
COMMON = ["--max_steps", str(STEPS)]
REPO = "hftk-test/tiny-gpt2-tp"


def _run(root, name: str, nproc: int, args: list[str]):
    out = root / name
    finetune(nproc, [*COMMON, "--output_dir", str(out), *args], timeout=600)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from hftk.data.builtin import materialize_model

    for name in ("builtin:llama-tiny", "builtin:neox-tiny"):
        materialize_model(name)  # once, before ranks race for it
    return tmp_path_factory.mktemp("tp")


@pytest.fixture(scope="module")
def probe(root):
    out = root / "probe.json"
    result = torchrun(2, ROOT / "tests" / "workers" / "tp_probe.py", [str(out)], timeout=600)
    assert result.returncode == 0, result.output[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def llama_ref(root):
    return _run(root, "llama_ref", 1, [*LLAMA, "--strategy", "tp", "--per_device_train_batch_size", "4",
                                       "--save_strategy", "steps", "--save_steps", "3"])


@pytest.fixture(scope="module")
def llama_tp(root):
    return _run(root, "llama_tp", 2, [*LLAMA, "--strategy", "tp", "--tp_size", "2", "--per_device_train_batch_size", "4",
                                      "--save_strategy", "steps", "--save_steps", "3"])


def _plain_loop(root, name: str, model: str):
    """The plain PyTorch loop with the mesh loop's settings: global batch 4, torch's AdamW (foreach)."""
    return plain_reference("loop", root / name, ["--max_steps", str(STEPS), "--batch_size", "4", "--optim",
                                                 "adamw_torch", "--eval"], model=model)


@pytest.fixture(scope="module")
def gpt2_ref(root):
    return _plain_loop(root, "gpt2_ref", GPT2[1])


@pytest.fixture(scope="module")
def gpt2_tp(root, hub):
    """Also pushes its final folder to a local stand-in Hub, and reports to wandb (offline)."""
    out = root / "gpt2_tp"
    finetune(2, [*COMMON, *GPT2, "--output_dir", str(out), "--strategy", "tp", "--tp_size", "2",
                 "--per_device_train_batch_size", "4", "--push_to_hub", "--hub_model_id", REPO, "--hub_strategy", "end",
                 "--report_to", "wandb"],
             timeout=600, env=hub_env(hub))
    return out


@pytest.fixture(scope="module")
def tp_fsdp(root):
    """2 tensor-parallel x 2 FSDP2 ranks: each FSDP rank reads half of the same global batch of 4."""
    return _run(root, "tp_fsdp", 4, [*LLAMA, "--strategy", "tp", "--tp_size", "2", "--dp_shard_size", "2",
                                     "--per_device_train_batch_size", "2"])


@pytest.fixture(scope="module")
def llama_cp(root):
    """Ring-attention context parallel: each of 2 ranks holds half of every sequence (FSDP2 over cp)."""
    return _run(root, "llama_cp", 2, [*LLAMA, "--strategy", "cp", "--cp_size", "2", "--per_device_train_batch_size", "4",
                                      "--save_strategy", "steps", "--save_steps", "3"])


@pytest.fixture(scope="module")
def gpt2_cp_tp(root):
    """CP=2 x TP=2 on 4 ranks: GPT-2's converted q/k/v split by heads, its sequences over the ring, and every
    block recomputed in backward (activation checkpointing is exact: compared with a run without it)."""
    return _run(root, "gpt2_cp_tp", 4, [*GPT2, "--strategy", "cp", "--cp_size", "2", "--tp_size", "2",
                                        "--per_device_train_batch_size", "4", "--gradient_checkpointing"])


@pytest.fixture(scope="module")
def bf16_runs(root):
    """``--bf16`` (autocast, fp32 weights): one process, and CP=2 on 2 ranks."""
    args = [*LLAMA, "--bf16", "--per_device_train_batch_size", "4"]
    return (_run(root, "llama_bf16_ref", 1, [*args, "--strategy", "tp"]),
            _run(root, "llama_bf16_cp", 2, [*args, "--strategy", "cp", "--cp_size", "2"]))


@pytest.fixture(scope="module")
def sp_run(root):
    return _run(root, "sp", 2, [*LLAMA, "--strategy", "sp", "--sp_size", "2", "--per_device_train_batch_size", "4",
                                "--save_strategy", "steps", "--save_steps", "3"])


def _layout(run) -> dict:
    return next(m for m in metrics(run) if "layout" in m)


def _assert_same_training(ref, run) -> None:
    expected, got = losses(ref), losses(run)
    assert sorted(expected) == sorted(got) == list(range(1, STEPS + 1))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], abs=TOL), step
    assert expected[STEPS] < expected[1]  # it learns
    assert max_weight_diff(load_weights(ref / "final"), load_weights(run / "final")) < TOL


def _eval_loss(run) -> float:
    return [m["eval_loss"] for m in metrics(run) if "eval_loss" in m][-1]


# ---------------------------------------------------------------- probe: sharding and logits


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama-tiny", "gpt2-tiny", "neox-tiny", "mistral", "qwen2"])
def test_weights_are_sharded_and_logits_match_one_process(probe, family):
    report = probe["tp"][family]
    assert probe["world_size"] == 2
    assert report["max_logit_diff"] < TOL
    assert report["logits_sharded_on_vocab"] and report["local_logits_shape"] == [2, 32, 1024]
    sharded = report["sharded"]
    assert len(sharded) >= report["n_params"] // 2, sorted(sharded)
    for name, shape in sharded.items():
        expected = list(shape["full"])
        if shape["placements"] != ["R"]:  # row-parallel biases are replicated DTensors
            expected[int(shape["placements"][0][2:-1])] //= 2  # "S(0)" / "S(1)"
        assert shape["local"] == expected, name
    assert report["tied"] == report["was_tied"]


@pytest.mark.slow
def test_gpt2_fused_qkv_is_split_by_heads(probe):
    sharded = probe["tp"]["gpt2-tiny"]["sharded"]
    for part in "qkv":
        assert sharded[f"transformer.h.0.attn.c_attn.{part}.weight"]["local"] == [32, 64]
    assert sharded["transformer.h.0.attn.c_proj.weight"]["local"] == [64, 32]
    assert sharded["transformer.wte.weight"]["local"] == [1024, 64]  # vocabulary-parallel, tied with lm_head


@pytest.mark.slow
def test_sequence_parallel_never_trains_in_eval_mode(probe):
    sp = probe["sp"]
    assert not sp["loaded_in_train_mode"]  # from_pretrained hands back eval mode
    assert sp["train_mode_after_layout"] and sp["train_mode_after_step"]
    assert sp["train_step_loss"] == pytest.approx(sp["expected"], abs=TOL)
    assert sp["eval_mode_loss"] == pytest.approx(sp["expected"], abs=TOL)
    # The trap hftk avoids: accelerate's registration silently changes the loss in eval mode.
    assert abs(sp["accelerate_eval_mode_loss"] - sp["expected"]) > 1e-4


# ---------------------------------------------------------------- training parity


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_tp2_trains_like_one_process(request, model):
    ref, run = request.getfixturevalue(f"{model}_ref"), request.getfixturevalue(f"{model}_tp")
    layout = _layout(run)
    assert layout["layout"]["world_size"] == 2 and layout["layout"]["tp_size"] == 2
    shapes = layout["local_shapes"]
    head = "lm_head.weight" if model == "llama" else "transformer.wte.weight"
    assert shapes[head]["local"] == [1024, 64] and shapes[head]["full"] == [2048, 64]
    _assert_same_training(ref, run)
    assert _eval_loss(run) == pytest.approx(_eval_loss(ref), abs=TOL)


@pytest.mark.slow
def test_the_one_process_llama_reference_trains_like_a_plain_loop(root, llama_ref):
    plain = _plain_loop(root, "llama_plain", LLAMA[1])
    _assert_same_training(plain, llama_ref)
    assert _eval_loss(llama_ref) == pytest.approx(_eval_loss(plain), abs=TOL)


@pytest.mark.slow
def test_tp2_x_fsdp2_on_four_ranks_trains_like_one_process(llama_ref, tp_fsdp):
    layout = _layout(tp_fsdp)
    assert layout["layout"]["world_size"] == 4
    assert (layout["layout"]["dp_shard_size"], layout["layout"]["tp_size"]) == (2, 2)
    q = layout["local_shapes"]["model.layers.0.self_attn.q_proj.weight"]
    assert q["full"] == [64, 64] and q["local"] == [16, 64] and len(q["placements"]) == 2  # 2-D: FSDP x TP
    _assert_same_training(llama_ref, tp_fsdp)


@pytest.mark.slow
def test_sp2_ulysses_trains_like_one_process(llama_ref, sp_run):
    layout = _layout(sp_run)["layout"]
    assert (layout["world_size"], layout["sp_size"], layout["dp_size"]) == (2, 2, 1)
    _assert_same_training(llama_ref, sp_run)
    assert _eval_loss(sp_run) == pytest.approx(_eval_loss(llama_ref), abs=TOL)


@pytest.mark.slow
def test_cp2_ring_attention_trains_like_one_process(llama_ref, llama_cp):
    layout = _layout(llama_cp)
    assert (layout["layout"]["world_size"], layout["layout"]["cp_size"], layout["layout"]["tp_size"]) == (2, 2, 1)
    q = layout["local_shapes"]["model.layers.0.self_attn.q_proj.weight"]
    assert q["full"] == [64, 64] and q["local"] == [32, 64] and q["placements"] == ["S(0)"]  # FSDP2 over cp
    _assert_same_training(llama_ref, llama_cp)
    assert _eval_loss(llama_cp) == pytest.approx(_eval_loss(llama_ref), abs=TOL)


@pytest.mark.slow
def test_cp2_x_tp2_with_activation_checkpointing_on_four_ranks_trains_like_one_process(gpt2_ref, gpt2_cp_tp):
    layout = _layout(gpt2_cp_tp)
    assert (layout["layout"]["world_size"], layout["layout"]["cp_size"], layout["layout"]["tp_size"]) == (4, 2, 2)
    assert layout["layout"]["activation_checkpointing"]  # the plain reference recomputes nothing
    q = layout["local_shapes"]["transformer.h.0.attn.c_attn.q.weight"]
    assert q["full"] == [64, 64] and q["local"] == [16, 64] and len(q["placements"]) == 2  # 2-D: FSDP(cp) x TP
    _assert_same_training(gpt2_ref, gpt2_cp_tp)
    assert _eval_loss(gpt2_cp_tp) == pytest.approx(_eval_loss(gpt2_ref), abs=TOL)


@pytest.mark.slow
def test_bf16_autocast_under_cp_matches_one_process_in_bf16(llama_ref, bf16_runs):
    ref, cp = bf16_runs
    assert _layout(cp)["layout"]["bf16"] and not _layout(llama_ref)["layout"]["bf16"]
    fp32, bf16, ring = losses(llama_ref), losses(ref), losses(cp)
    assert sorted(ring) == list(range(1, STEPS + 1))
    assert max(abs(bf16[s] - fp32[s]) for s in fp32) > 1e-5  # autocast really computes in bf16
    assert max(abs(ring[s] - fp32[s]) for s in fp32) > 1e-5
    for step in bf16:  # bf16 rounding (seen: 1.6e-4); a ring that missed a block would be off by far more
        assert ring[step] == pytest.approx(bf16[step], abs=1e-3), step
    assert _eval_loss(cp) == pytest.approx(_eval_loss(ref), abs=1e-3)


# ---------------------------------------------------------------- checkpoints and export


def _resume(checkpoint, out, nproc: int, layout: list[str]):
    """A new run folder holding only ``checkpoint``, continued to the end with ``layout``."""
    out.mkdir()
    shutil.copytree(checkpoint, out / checkpoint.name)
    finetune(nproc, [*COMMON, *LLAMA, *layout, "--output_dir", str(out), "--resume_from_checkpoint", "latest"],
             timeout=600)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("run,layout", [("llama_tp", ["--strategy", "tp", "--tp_size", "2"]),
                                        ("llama_cp", ["--strategy", "cp", "--cp_size", "2"])])
def test_resume_under_tp_or_cp_is_exact(request, run, layout, tmp_path):
    full_run = request.getfixturevalue(run)
    resumed = _resume(full_run / "checkpoint-3", tmp_path / "resumed", 2,
                      [*layout, "--per_device_train_batch_size", "4"])
    full, after = losses(full_run), losses(resumed)
    assert sorted(after) == [4, 5]
    for step in after:
        assert after[step] == pytest.approx(full[step], abs=1e-6), step
    assert max_weight_diff(load_weights(full_run / "final"), load_weights(resumed / "final")) < 1e-6


@pytest.mark.slow
def test_final_folder_of_a_tp_run_is_pushed_to_the_hub(gpt2_tp, hub):
    from hftk.checkpoint.run_record import CARD_FILE
    from hftk.publish.hub import folder_files

    files = hub.state.files(REPO)
    local = folder_files(gpt2_tp / "final")
    assert set(files) == {".gitattributes", *local}
    assert files["model.safetensors"] == (gpt2_tp / "final" / "model.safetensors").read_bytes()
    assert "**tp** over 2 process(es)" in files[CARD_FILE].decode()
    assert [m["hub_push"] for m in metrics(gpt2_tp) if "hub_push" in m] == ["ok"]


@pytest.mark.slow
def test_tp_reports_to_wandb_through_the_trainers_callback(gpt2_tp):
    run = wandb_run(gpt2_tp)
    logged = {row["train/global_step"]: row["train/loss"] for row in run["history"] if "train/loss" in row}
    assert logged == pytest.approx(losses(gpt2_tp), abs=1e-6)
    assert [row["eval/loss"] for row in run["history"] if "eval/loss" in row] == [_eval_loss(gpt2_tp)]
    assert (run["config"]["strategy"], run["config"]["tp_size"]) == ("tp", 2)


@pytest.mark.slow
def test_memory_per_rank_shrinks_with_the_mesh(llama_ref, llama_tp, tp_fsdp):
    """Counted model state per rank (params, grads, AdamW state) after the first step, from metrics.jsonl."""
    def per_rank(run):
        ranks = next(m["memory"] for m in metrics(run) if "memory" in m)
        assert all(r["peak"] >= r["total"] for r in ranks), ranks  # the counted tensors are resident in the peak
        return ranks

    ref, = per_rank(llama_ref)
    tp, fsdp = per_rank(llama_tp), per_rank(tp_fsdp)
    assert len(tp) == 2 and len(fsdp) == 4
    for key in ("params", "grads", "optimizer"):
        # norms stay whole under TP (a few KiB): close to 1/2, and to 1/4 with FSDP2 on top
        assert all(0.5 <= r[key] / ref[key] < 0.52 for r in tp), (key, tp, ref)
        assert all(0.25 <= r[key] / ref[key] < 0.27 for r in fsdp), (key, fsdp, ref)


@pytest.mark.slow
def test_memory_plan_predicts_the_counted_model_state(llama_tp, tp_fsdp, sp_run, llama_cp):
    """`hftk plan --tp_size / --sp_size / --cp_size` rows (from the config alone) equal what each rank counted."""
    from hftk.data.builtin import builtin_model_config
    from hftk.plan.estimate import PlanInputs, model_shape
    from hftk.strategies import sequence, tensor, tp_plans

    config = builtin_model_config("builtin:llama-tiny")
    shape, replicated = model_shape(config), tp_plans.replicated_params(config)
    for run, world, estimate in [(llama_tp, 2, lambda i: tensor.estimate_memory(shape, i, 2, replicated)),
                                 (tp_fsdp, 4, lambda i: tensor.estimate_memory(shape, i, 2, replicated)),
                                 (sp_run, 2, lambda i: sequence.estimate_memory(shape, i, 2)),
                                 (llama_cp, 2, lambda i: tensor.estimate_memory(shape, i, 1, replicated, cp=2))]:
        plan = estimate(PlanInputs(world_size=world, device_memory_bytes=2**34, seq_len=64, micro_batch=4, device="cpu"))
        for rank in next(m["memory"] for m in metrics(run) if "memory" in m):
            assert (plan.params, plan.grads, plan.optimizer) == (rank["params"], rank["grads"], rank["optimizer"]), run


@pytest.mark.slow
def test_the_mesh_loop_monitors_every_rank(llama_tp, tp_fsdp, sp_run, llama_cp):
    """As on the Trainer path: each logging step, every rank's times, memory and counted tensors reach
    metrics.jsonl and the log line; step 3 is profiled, and the layout's traffic is on the wire there."""
    for run, world in [(llama_tp, 2), (tp_fsdp, 4), (sp_run, 2), (llama_cp, 2)]:
        records = {m["step"]: m for m in metrics(run) if "rank_stats" in m}
        assert sorted(records) == list(range(1, STEPS + 1)), run
        for record in records.values():
            stats = record["rank_stats"]
            assert all(len(values) == world for values in stats.values()), run
            # per rank: compute is part of its step; its counted tensors are resident in its peak
            assert all(p >= t for p, t in zip(stats["peak_mem_mb"], stats["tensor_mb"])), (run, stats)
            if record["step"] == 1:  # the process's first step is one-time work: no compute verdict on it
                assert stats["compute_time_s"] == [None] * world and record["rank_wait_share"] is None, (run, stats)
                continue
            assert all(c <= s for c, s in zip(stats["compute_time_s"], stats["step_time_s"])), (run, stats)
        shares = records[3]["rank_stats"]["comm_share"]
        assert all(0 < share < 1 for share in shares), (run, shares)
        assert records[2]["rank_stats"]["comm_share"] == [None] * world  # only step 3 is profiled
        logged = next(m for m in metrics(run) if m.get("step") == 3 and "loss" in m)
        assert logged["comm_share"] == pytest.approx(sum(shares) / world)
        assert logged["step_time_s_max"] == pytest.approx(max(records[3]["rank_stats"]["step_time_s"]), rel=1e-6)
        training_peak = next(m["memory"] for m in metrics(run) if "memory" in m)
        peaks = [max(r["rank_stats"]["peak_mem_mb"][rank] for r in records.values()) for rank in range(world)]
        assert all(entry["peak"] / 2**20 >= 0.99 * peak for entry, peak in zip(training_peak, peaks)), run
    # compute time measured everywhere: autograd accumulates into the TP / SP leaves, FSDP2 calls the
    # post-accumulate-grad hooks itself after its reduce-scatter
    from hftk.config.options import TrackingConfig

    for run in (llama_tp, tp_fsdp, sp_run, llama_cp):
        for record in (m for m in metrics(run) if "rank_stats" in m and m["step"] > 1):
            compute, steps = record["rank_stats"]["compute_time_s"], record["rank_stats"]["step_time_s"]
            assert None not in compute, (run, record)
            # the verdict from the per-rank lists: the fastest rank's idle share of the slowest wall step
            wait = min((max(compute) - min(compute)) / max(steps), 1.0)
            assert record["rank_wait_share"] == pytest.approx(wait, rel=1e-6), (run, record)
            assert record["imbalance_warning"] == (wait > TrackingConfig().imbalance_warn_threshold), (run, record)


@pytest.mark.slow
def test_a_tp_checkpoint_resumes_on_a_3d_mesh(llama_tp, tmp_path):
    """TP=2 checkpoint -> dp_replicate 2 x dp_shard 1 x tp 2 (HSDP x TP, 4 ranks; DCP reshards), same global batch."""
    resumed = _resume(llama_tp / "checkpoint-3", tmp_path / "resumed3d", 4,
                      ["--strategy", "tp", "--tp_size", "2", "--dp_replicate_size", "2",
                       "--per_device_train_batch_size", "2"])
    q = _layout(resumed)["local_shapes"]["model.layers.0.self_attn.q_proj.weight"]
    assert len(q["placements"]) == 3 and q["local"] == [32, 64]  # replicated x (1-way) sharded x TP
    _assert_continues(llama_tp, resumed)


@pytest.mark.slow
@pytest.mark.parametrize("run, layout", [
    ("llama_cp", ["--strategy", "cp", "--cp_size", "2", "--dp_replicate_size", "2"]),  # FSDP(cp) -> HSDP x cp
    ("sp_run", ["--strategy", "sp", "--sp_size", "2"]),  # sp 2 -> 2 data-parallel groups of sp 2
])
def test_a_cp_or_sp_checkpoint_resumes_on_four_ranks(request, run, layout, tmp_path):
    """Saved on 2 ranks (one data-parallel group, batch 4), resumed on 4 (two groups, batch 2): the same global
    batch, DCP reshards; the saved seal's world size differs, which validate.check_world_change lets through."""
    saved = request.getfixturevalue(run)
    resumed = _resume(saved / "checkpoint-3", tmp_path / "resumed4", 4, [*layout, "--per_device_train_batch_size", "2"])
    _assert_continues(saved, resumed)


def _assert_continues(full_run, resumed) -> None:
    """Steps 4-5 and the final weights of ``resumed`` equal the uninterrupted ``full_run``'s."""
    full, after = losses(full_run), losses(resumed)
    assert sorted(after) == [4, 5]
    for step in after:
        assert after[step] == pytest.approx(full[step], abs=TOL), step
    assert max_weight_diff(load_weights(full_run / "final"), load_weights(resumed / "final")) < TOL


@pytest.mark.slow
def test_export_of_tp_and_cp_checkpoints_equals_the_reference(llama_ref, llama_tp, llama_cp, tmp_path):
    from hftk.publish.export import main as export_main

    assert export_main([str(llama_ref / "checkpoint-3"), str(tmp_path / "ref")]) == 0
    for name, run in (("tp", llama_tp), ("cp", llama_cp)):
        assert export_main([str(run / "checkpoint-3"), str(tmp_path / name)]) == 0
        assert max_weight_diff(load_weights(tmp_path / "ref"), load_weights(tmp_path / name)) < TOL, name


@pytest.mark.slow
def test_hftk_generate_reads_a_tp_checkpoint_without_export(llama_ref, llama_tp, tmp_path):
    """The tp mesh checkpoint, consolidated in one process by ``hftk generate``, says what the one-process
    reference's checkpoint says through plain ``generate``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hftk.publish.export import main as export_main

    assert export_main([str(llama_ref / "checkpoint-3"), str(tmp_path / "ref")]) == 0
    want = greedy_ids(AutoModelForCausalLM.from_pretrained(tmp_path / "ref"), AutoTokenizer.from_pretrained(tmp_path / "ref"))
    assert hftk_greedy_ids(llama_tp / "checkpoint-3") == want


@pytest.mark.slow
@pytest.mark.parametrize("model,run", [("llama", "llama_tp"), ("gpt2", "gpt2_tp"), ("llama", "llama_cp")])
def test_final_folder_reloads_with_from_pretrained_and_gives_the_reference_eval_loss(request, model, run, tmp_path):
    from transformers import AutoModelForCausalLM

    from hftk.data.dataset import collator, tokenize_and_pack
    from hftk.models.loading import load_tokenizer
    from hftk.run.prepare import prepare
    from hftk.strategies.mesh import loss_sum, model_batch, token_count

    ref, run = request.getfixturevalue(f"{model}_ref"), request.getfixturevalue(run)
    prepared = prepare([*TINY_ARGS, *(LLAMA if model == "llama" else GPT2), "--output_dir", str(tmp_path / "x")])
    data = tokenize_and_pack(prepared.cfg.data, prepared.raw, load_tokenizer(prepared.cfg.model),
                             prepared.data_format, prepared.cfg.training["seed"])
    reloaded = AutoModelForCausalLM.from_pretrained(run / "final").eval()
    total = tokens = 0.0
    with torch.no_grad():
        for start in range(0, len(data.eval), 8):
            collate = collator(prepared.cfg.data, 0, fixed_length=prepared.cfg.data.block_size)
            batch = model_batch(collate([data.eval[i] for i in range(start, min(start + 8, len(data.eval)))]), "cpu")
            total += float(loss_sum(reloaded, batch))
            tokens += float(token_count(batch))
    assert total / tokens == pytest.approx(_eval_loss(ref), abs=TOL)
