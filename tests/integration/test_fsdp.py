"""FSDP2 over gloo through the HF Trainer: really sharded (not DDP), losses equal a plain
``transformers.Trainer`` on one process, sharded and full checkpoints resume exactly, export and final
save give complete tied weights.

Runs, shared by the module fixture (tiny tied GPT-2, fp32, clipping at 1.0 everywhere):
- ``single``: the reference, tests/reference/plain.py's plain Trainer (no hftk) on 1 process, batch 8, 12 steps.
- ``ddp``: 2 ranks x 4, one step: the per-rank model-state bytes FSDP is compared with.
- ``fsdp``: 2 ranks x 4, 12 steps, sharded checkpoints at 4, 8, 12.
- ``full``: resumes ``fsdp``'s checkpoint-4 (``latest``) with ``fsdp_state_dict full`` and
  ``fsdp_reshard_after_forward false``: sharded load, full saves at 8 and 12.
- ``back``: resumes ``full``'s checkpoint-8 (full load) sharded again, with ``fsdp_cpu_offload``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import (FINETUNE, TINY_ARGS, finetune, load_weights, losses, max_weight_diff, metrics,
                           plain_reference, python)

STEPS = 12
COMMON = ["--max_steps", str(STEPS), "--max_grad_norm", "1.0", "--per_device_train_batch_size", "4",
          "--save_strategy", "steps", "--save_steps", "4"]
# Eval batch 1: the Trainer then drops exactly the samples it padded the last 2-rank batch with,
# so the live eval_loss is the plain per-sample mean that one process computes.
FSDP = ["--strategy", "fsdp", *COMMON, "--per_device_eval_batch_size", "1"]


def _resume_in(root, name: str, source, args: list[str]):
    """Copy one checkpoint into a fresh output dir and continue it with ``latest``."""
    out = root / name
    out.mkdir()
    shutil.copytree(source, out / source.name)
    finetune(2, [*FSDP, *args, "--output_dir", str(out), "--resume_from_checkpoint", "latest"], timeout=400)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    plain_reference("trainer", root / "single", ["--max_steps", str(STEPS), "--max_grad_norm", "1.0",
                                                 "--batch_size", "8"])
    finetune(2, ["--max_steps", "1", "--per_device_train_batch_size", "4", "--output_dir", str(root / "ddp")])
    finetune(2, [*FSDP, "--output_dir", str(root / "fsdp")], timeout=400)
    full = _resume_in(root, "full", root / "fsdp" / "checkpoint-4",
                      ["--fsdp_state_dict", "full", "--fsdp_reshard_after_forward", "false"])
    _resume_in(root, "back", full / "checkpoint-8", ["--fsdp_cpu_offload"])
    return root


def model_state(output_dir: Path) -> list[dict[str, int]]:
    rows = [m["model_state"] for m in metrics(output_dir) if "model_state" in m]
    assert len(rows) == 1, rows
    return rows[0]


@pytest.mark.slow
def test_losses_match_a_plain_trainer_on_one_process(runs):
    ref, got = losses(runs / "single"), losses(runs / "fsdp")
    assert sorted(ref) == sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-5), step  # measured: 9.5e-7
    assert ref[STEPS] < ref[1]  # it learns
    assert max_weight_diff(load_weights(runs / "single" / "final"), load_weights(runs / "fsdp" / "final")) < 1e-5


@pytest.mark.slow
def test_each_rank_holds_half_and_at_most_055_of_ddp(runs):
    fsdp, ddp = model_state(runs / "fsdp"), model_state(runs / "ddp")
    assert len(fsdp) == len(ddp) == 2
    for rank in fsdp:
        assert rank["param_elements"] == pytest.approx(rank["param_elements_full"] / 2, rel=0.01)
        # counted with gradients and AdamW state present: a gradient shard per parameter shard, two moments per
        # element plus torch AdamW's float32 step counter per tensor (gpt2-tiny: 28 parameter tensors)
        assert rank["grads"] == rank["params"], rank
        assert rank["optimizer"] == 2 * rank["params"] + 4 * 28, rank
    assert sum(r["param_elements"] for r in fsdp) == fsdp[0]["param_elements_full"]  # disjoint shards
    for mine, replica in zip(fsdp, ddp):
        assert replica["param_elements"] == replica["param_elements_full"]
        assert mine["total"] <= 0.55 * replica["total"], (mine, replica)


@pytest.mark.slow
def test_checkpoints_hold_sharded_or_full_state(runs):
    sharded = runs / "fsdp" / "checkpoint-4"
    for part in ("fsdp_model", "fsdp_optimizer"):
        assert (sharded / part / ".metadata").is_file()
        assert sorted(p.name for p in (sharded / part).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (sharded / "model.safetensors").exists()  # no gather to rank 0 inside a sharded checkpoint
    full = runs / "full" / "checkpoint-8"
    assert (full / "model.safetensors").is_file() and (full / "fsdp_optimizer_full.pt").is_file()
    assert not (full / "fsdp_model").exists()
    for ckpt in (sharded, full):
        for name in ("config.json", "tokenizer.json", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth",
                     "trainer_state.json"):
            assert (ckpt / name).is_file(), (ckpt, name)


@pytest.mark.slow
def test_resume_is_exact_across_formats(runs):
    whole = losses(runs / "fsdp")
    full, back = losses(runs / "full"), losses(runs / "back")
    assert sorted(full) == list(range(5, STEPS + 1)) and sorted(back) == list(range(9, STEPS + 1))
    for part in (full, back):
        for step, loss in part.items():
            assert loss == pytest.approx(whole[step], abs=1e-6), step
    final = load_weights(runs / "fsdp" / "final")
    assert max_weight_diff(final, load_weights(runs / "full" / "final")) < 1e-6
    assert max_weight_diff(final, load_weights(runs / "back" / "final")) < 1e-6


@pytest.mark.slow
def test_final_folder_is_complete_with_tied_weights(runs):
    from transformers import AutoModelForCausalLM

    final = runs / "fsdp" / "final"
    saved = load_weights(final)
    assert "transformer.wte.weight" in saved and "lm_head.weight" not in saved  # stored once
    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(model.transformer.wte.weight, saved["transformer.wte.weight"])
    assert all(v.numel() > 0 for v in saved.values())


def _eval_loss(model_dir: Path, tmp_path: Path) -> float:
    """The Trainer's eval_loss of ``model_dir`` on the run's held-out blocks, in this one process."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

    from hftk.data.dataset import tokenize_and_pack
    from hftk.models.loading import load_tokenizer
    from hftk.run.prepare import prepare

    prepared = prepare([*TINY_ARGS, "--output_dir", str(tmp_path / "probe")])
    cfg = prepared.cfg
    blocks = tokenize_and_pack(cfg.data, prepared.raw, load_tokenizer(cfg.model), prepared.data_format,
                               cfg.training["seed"]).eval
    args = TrainingArguments(output_dir=str(tmp_path / "eval"), use_cpu=True, per_device_eval_batch_size=1,
                             report_to=[], disable_tqdm=True)
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args, eval_dataset=blocks,
                      data_collator=default_data_collator)
    return trainer.evaluate()["eval_loss"]


@pytest.mark.slow
def test_export_reloads_with_the_live_eval_loss(runs, tmp_path):
    from hftk.publish.export import export

    live = [m["eval_loss"] for m in metrics(runs / "fsdp") if "eval_loss" in m][-1]
    sharded, full = tmp_path / "from_sharded", tmp_path / "from_full"
    assert export(runs / "fsdp" / f"checkpoint-{STEPS}", sharded) == "fsdp-sharded"
    assert export(runs / "full" / f"checkpoint-{STEPS}", full) == "safetensors"
    final = load_weights(runs / "fsdp" / "final")
    assert max_weight_diff(final, load_weights(sharded)) == 0.0
    assert max_weight_diff(final, load_weights(full)) < 1e-6
    assert _eval_loss(sharded, tmp_path) == pytest.approx(live, abs=1e-5)


TWO = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}  # what torchrun sets; validation runs before any group
ERRORS = [
    ("world_size_1", ["--strategy", "fsdp"], {}, "strategy.strategy"),
    ("offload_without_fsdp", ["--fsdp_cpu_offload"], {}, "strategy.fsdp_cpu_offload"),
    ("trainer_fsdp_too", ["--strategy", "fsdp", "--fsdp", "full_shard"], TWO, "training.fsdp"),
    ("hybrid_uneven_nodes", ["--strategy", "fsdp", "--fsdp_hybrid"], {"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "2"},
     "strategy.fsdp_hybrid"),
]


@pytest.mark.parametrize("case_id,args,env,field", ERRORS, ids=[c[0] for c in ERRORS])
def test_bad_combination_is_one_clear_line(case_id, args, env, field, tmp_path):
    out = tmp_path / "out"
    result = python([str(FINETUNE), *TINY_ARGS, "--output_dir", str(out), *args], timeout=120, env=env)
    assert result.returncode == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip() and "Setting accelerator" not in line]
    assert len(lines) == 1 and lines[0].startswith("hftk: error: ") and field in lines[0], result.stderr
    assert "Fix:" in lines[0] and "Traceback" not in result.output
    assert not out.exists()
