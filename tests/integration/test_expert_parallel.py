"""Expert parallel (strategy ep) past what the support matrix runs (2 ranks, ep 2: parity, LoRA and a resume at
another ep or world size on every MoE family): 4 ranks in ep groups of 2, so each expert is also FSDP2-sharded over
the 2 ranks that hold it; a preemption that saves and exits 75; its checkpoint resumed on 4 ranks in one ep group
(one expert each); the export's per-expert folder.

One model (OLMoE-shaped: 4 experts, top-2, every layer MoE), one global batch of 4 rows (4 micro-batches of one
row: the balancing loss is their mean however the ranks hold them). The reference is tests/reference/plain.py's
loop on one process (no hftk), cut into the same 4 micro-batches, experts run grouped_mm as hftk runs them.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import (FINETUNE, ROOT, load_weights, losses, make_family, max_weight_diff, metrics,
                           plain_reference, rank_exit_codes, torchrun)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 3
TOLERANCE = 1e-5
EXIT_PREEMPTED = 75
ARGS = ["--strategy", "ep", "--model_dropout", "0", "--block_size", "32", "--max_train_samples", "200",
        "--max_steps", str(STEPS), "--lr_scheduler_type", "constant", "--learning_rate", "1e-3", "--warmup_steps", "0",
        "--optim", "adamw_torch", "--logging_steps", "1", "--eval_strategy", "no", "--report_to", "none",
        "--disable_tqdm", "true", "--seed", "7", "--save_strategy", "steps", "--save_steps", "2"]


def run(root, name: str, nproc: int, args: list[str], script=FINETUNE, env: dict[str, str] | None = None):
    result = torchrun(nproc, script, [*ARGS, "--model_name_or_path", str(root / "olmoe"), *args,
                                      "--output_dir", str(root / name)], timeout=600, env=env)
    return root / name, result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(root, the reference, the 4-rank run, the preempted 2-rank run's launch, its 4-rank resume)."""
    root = tmp_path_factory.mktemp("ep")
    make_family("olmoe", root / "olmoe")
    reference = plain_reference("loop", root / "reference", [
        "--max_steps", str(STEPS), "--batch_size", "4", "--micro_batches", "4", "--block_size", "32",
        "--max_train_samples", "200", "--optim", "adamw_torch", "--loss_divisor", "targets",
        "--experts_implementation", "grouped_mm"], model=root / "olmoe")
    whole, done = run(root, "ep2-of-4", 4, ["--ep_size", "2", "--per_device_train_batch_size", "1"])
    assert done.returncode == 0, done.output[-6000:]
    stopped, preempted = run(root, "preempted", 2, ["--per_device_train_batch_size", "1",
                                                    "--gradient_accumulation_steps", "2"],
                             script=ROOT / "tests" / "workers" / "sigterm_at_step.py",
                             env={"HFTK_SIGTERM_AT_STEP": "2"})
    resumed, again = run(root, "preempted", 4, ["--ep_size", "4", "--per_device_train_batch_size", "1",
                                                "--resume_from_checkpoint", "latest"])
    assert again.returncode == 0, again.output[-6000:]
    return root, reference, whole, preempted, resumed


def test_experts_split_over_ep_and_sharded_over_their_holders_train_like_one_process(runs):
    """4 ranks, ep 2: each rank's experts are 2 of 4 (its ep group's half), FSDP2-sharded again between the 2 ranks
    that hold them (1 expert's rows each); losses and final weights equal the one-process run's."""
    _, reference, whole, _, _ = runs
    got, want = losses(whole), losses(reference)
    assert got == pytest.approx(want, abs=TOLERANCE), (got, want)
    assert max_weight_diff(load_weights(whole / "final"), load_weights(reference / "final")) < TOLERANCE
    layout = next(m for m in metrics(whole) if "layout" in m)
    assert {k: layout["layout"][k] for k in ("strategy", "ep_size", "dp_shard_mod_ep_size", "experts_per_rank")} == \
        {"strategy": "ep", "ep_size": 2, "dp_shard_mod_ep_size": 2, "experts_per_rank": 2}
    experts = layout["local_shapes"]["model.layers.0.mlp.experts.gate_up_proj"]
    assert experts["full"][0] == 4 and experts["local"][0] == 1, experts  # 4 experts / ep 2 / 2 holders
    dense = layout["local_shapes"]["model.layers.0.self_attn.q_proj.weight"]
    assert dense["local"][0] * 4 == dense["full"][0], dense  # the dense parts over all 4 ranks


def test_the_all_to_all_is_counted_per_step(runs):
    """Each MoE layer's forward exchanges the counts, sends the tokens and brings them back; backward sends both
    again: 5 all-to-alls per layer (2 layers) and micro-batch (1 per rank here), bytes within the most a
    (token, expert) pair can cost (every pair to another rank)."""
    _, _, whole, _, _ = runs
    logged = [m for m in metrics(whole) if "loss" in m]
    assert len(logged) == STEPS and all(m["ep_all_to_all_per_step"] == 10 for m in logged), logged
    most = 4 * 2 * 32 * 2 * 64 * 4 + 8 * 2 * 2  # 4 passes x layers x tokens x top-2 x hidden fp32, + the counts
    assert all(0 < m["ep_all_to_all_bytes_per_step"] <= most for m in logged), logged
    assert all(m["moe_aux_loss"] > 0 and m["expert_load_max_mean"] >= 1 for m in logged), logged


def test_sigterm_saves_exits_75_and_the_run_resumes_on_another_world_and_ep_size(runs):
    """SIGTERM on every rank inside step 2 of a 2-rank run (ep 2, 2 micro-batches each): checkpoint-2 sealed, exit
    75 everywhere; resumed on 4 ranks with ep 4 (the experts redistributed, one per rank), step 3 and the final
    weights equal the uninterrupted 4-rank run's."""
    from hftk.checkpoint.atomic import is_complete

    _, _, whole, preempted, resumed = runs
    assert rank_exit_codes(preempted) == {0: EXIT_PREEMPTED, 1: EXIT_PREEMPTED}, preempted.output[-6000:]
    assert "hftk: stopped at step 2: preempted (SIGTERM)" in preempted.output, preempted.output[-4000:]
    assert is_complete(resumed / "checkpoint-2")
    saved = json.loads((resumed / "checkpoint-2" / "hftk_mesh.json").read_text())
    assert (saved["ep_size"], saved["dp_shard_size"]) == (2, 2)
    after = losses(resumed)
    assert after[3] == pytest.approx(losses(whole)[3], abs=1e-6), (after, losses(whole))
    assert max_weight_diff(load_weights(resumed / "final"), load_weights(whole / "final")) < 1e-6


def test_export_writes_the_per_expert_folder_that_loads_to_the_same_logits(runs, tmp_path):
    """``hftk export`` of an ep checkpoint (no process group): the names transformers writes for OLMoE's experts
    (one module per expert, not the fused tensors) and the logits of the run's own final folder."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from hftk.cli import main as hftk

    _, _, whole, _, _ = runs
    assert hftk(["export", str(whole / f"checkpoint-{STEPS}"), str(tmp_path / "exported")]) == 0
    with safe_open(str(tmp_path / "exported" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names and not any(n.endswith("gate_up_proj") for n in names)
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(whole / "final").eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()(ids).logits
    assert torch.equal(got, want)


