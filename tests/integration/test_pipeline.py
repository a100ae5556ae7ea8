"""Pipeline parallelism: stages cut from the HF model's own structure, every schedule exact against
a plain PyTorch loop on one process (losses, gradient norms and weights, tied embeddings included),
pp x dp on 4 ranks, exact resume, export to a standard HF folder, and the CLI's one-line error (the
in-process checks: tests/unit/strategies/test_pipeline.py).

The reference of each model is tests/reference/plain.py's loop (no hftk, no Trainer), with the
Trainer's fused AdamW and its loss divisor, which the pipeline engine follows: the Trainer counts
``num_items_in_batch`` as the predicted tokens for a model whose ``loss_type`` is ForCausalLM (Llama)
and as every label otherwise (GPT-2, 1/64 more at block size 64). Launches are shared
(``tests.helpers.finetune_cells``): one 2-rank launch running all three schedules of both models and
the resume, one 4-rank pp x dp launch.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.faults import hub_env
from tests.helpers import (FINETUNE, TINY_ARGS, finetune_cells, load_weights, losses, max_weight_diff, metrics,
                           plain_reference, python)
from tests.unit.strategies.test_pipeline import MODELS, PIPE

STEPS = 5
DIVISORS = {"gpt2": "labels", "llama": "targets"}  # the Trainer's num_items_in_batch for each (see above)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
REPO = "hftk-test/tiny-gpt2-pipeline"
COMMON = ["--max_steps", str(STEPS), "--per_device_train_batch_size", "8"]
pytestmark = pytest.mark.timeout(1800)  # the first slow test launches every run


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hub):
    """The 4-rank pp x dp run also pushes its final folder to a local stand-in Hub."""
    root = tmp_path_factory.mktemp("pipeline")
    for name, model in MODELS.items():
        plain_reference("loop", root / f"ref-{name}", ["--max_steps", str(STEPS), "--batch_size", "8", "--optim",
                                                       "adamw_torch_fused", "--loss_divisor", DIVISORS[name], "--eval"],
                        model=model)
    two = {}
    for name, model in MODELS.items():
        save = ["--save_strategy", "steps", "--save_steps", "3"] if name == "gpt2" else []
        two.update({f"{name}-{s}": ["--model_name_or_path", model, *COMMON, *PIPE, *save, "--pp_schedule", s,
                                    "--output_dir", str(root / f"{name}-{s}")] for s in SCHEDULES})
    resumed = root / "gpt2-resumed"
    gpt2 = ["--model_name_or_path", MODELS["gpt2"]]
    two["gpt2-resumed"] = [*gpt2, *COMMON, *PIPE, "--pp_schedule", "gpipe", "--output_dir", str(resumed),
                           "--resume_from_checkpoint", "latest"]
    finetune_cells(2, two, root, options={"gpt2-resumed": {"copy": [root / "gpt2-gpipe" / "checkpoint-3",
                                                                    resumed / "checkpoint-3"]}})
    finetune_cells(4, {"gpt2-dp": [*gpt2, *PIPE, "--max_steps", str(STEPS), "--per_device_train_batch_size",
                                   "4", "--pp_schedule", "1f1b", "--check_sync_steps", "1", "--output_dir",
                                   str(root / "gpt2-dp"), "--push_to_hub", "--hub_model_id", REPO,
                                   "--hub_strategy", "end"]}, root, env=hub_env(hub))
    return root


CASES = [(m, s) for m in MODELS for s in SCHEDULES] + [("gpt2", "dp")]


@pytest.mark.slow
@pytest.mark.parametrize("model,schedule", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_losses_and_weights_equal_a_plain_loop(runs, model, schedule):
    ref, got = losses(runs / f"ref-{model}"), losses(runs / f"{model}-{schedule}")
    assert sorted(ref) == sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-5), step
    assert ref[STEPS] < ref[1]  # it learns
    assert max_weight_diff(load_weights(runs / f"ref-{model}" / "final"),
                           load_weights(runs / f"{model}-{schedule}" / "final")) < 1e-5
    grad_norms = {m["step"]: m["grad_norm"] for m in metrics(runs / f"{model}-{schedule}") if "grad_norm" in m}
    ref_norms = {m["step"]: m["grad_norm"] for m in metrics(runs / f"ref-{model}") if "grad_norm" in m}
    assert all(grad_norms[s] == pytest.approx(ref_norms[s], rel=1e-4) for s in ref_norms)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tied_embedding_copies_stay_equal(runs, schedule):
    """wte lives on the first stage, lm_head (the same weight) on the last: both copies equal the reference."""
    from safetensors.torch import load_file

    ckpt = runs / f"gpt2-{schedule}" / f"checkpoint-{STEPS}"
    info = json.loads((ckpt / "pipeline.json").read_text())
    first = load_file(str(ckpt / "stage-00.safetensors"))
    last = load_file(str(ckpt / f"stage-{info['num_stages'] - 1:02d}.safetensors"))
    assert info["tied"] == ["transformer.wte.weight", "lm_head.weight"]
    assert "lm_head.weight" not in first and "transformer.wte.weight" not in last
    assert torch.equal(first["transformer.wte.weight"], last["lm_head.weight"])
    ref = load_weights(runs / "ref-gpt2" / "final")["transformer.wte.weight"]
    assert float((first["transformer.wte.weight"] - ref).abs().max()) < 1e-5


@pytest.mark.slow
def test_stages_split_the_blocks(runs):
    """Each stage file holds its own blocks only: 2 stages per schedule, 4 for interleaved (2 per rank)."""
    from safetensors.torch import load_file

    for schedule, stages in (("1f1b", 2), ("interleaved_1f1b", 4)):
        ckpt = runs / f"gpt2-{schedule}" / f"checkpoint-{STEPS}"
        blocks = []
        for i in range(stages):
            keys = load_file(str(ckpt / f"stage-{i:02d}.safetensors")).keys()
            blocks.append(sorted({k.split(".")[2] for k in keys if k.startswith("transformer.h.")}))
        assert blocks == ([["0", "1"], ["2", "3"]] if stages == 2 else [["0"], ["1"], ["2"], ["3"]])
        assert json.loads((ckpt / "pipeline.json").read_text())["stage_ranks"] == {
            str(i): i % 2 for i in range(stages)}


@pytest.mark.slow
def test_pipeline_x_data_parallel_replicas_agree(runs):
    sync = [m for m in metrics(runs / "gpt2-dp") if "param_digests" in m]
    assert [m["step"] for m in sync] == list(range(1, STEPS + 1))
    for m in sync:
        d = m["param_digests"]  # ranks 0,1 = replica 0 (stages 0,1); ranks 2,3 = replica 1
        assert len(d) == 4 and m["ranks_in_sync"]
        assert d[0] == d[2] and d[1] == d[3] and d[0] != d[1]


@pytest.mark.slow
def test_resume_from_checkpoint_is_exact(runs):
    full, after = losses(runs / "gpt2-gpipe"), losses(runs / "gpt2-resumed")
    assert sorted(after) == [4, 5]
    for step in after:
        assert after[step] == pytest.approx(full[step], abs=1e-6), step
    assert max_weight_diff(load_weights(runs / "gpt2-gpipe" / "final"), load_weights(runs / "gpt2-resumed" / "final")) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("folder,processes,replicas", [("gpt2-gpipe", 2, 1), ("gpt2-dp", 4, 2)])
def test_run_record_and_card_count_processes_and_replicas(runs, folder, processes, replicas):
    """2 stages on 2 processes is one replica over 2 processes (it was recorded as 1 process); the
    global batch counts replicas only."""
    from hftk.checkpoint.run_record import CARD_FILE, RUN_FILE

    final = runs / folder / "final"
    record = json.loads((final / RUN_FILE).read_text())
    assert (record["world_size"], record["data_parallel_size"]) == (processes, replicas)
    hyper = record["hyperparameters"]
    assert hyper["global_batch_size"] == hyper["per_device_train_batch_size"] * replicas
    card = (final / CARD_FILE).read_text()
    assert f"**pipeline** over {processes} process(es), {replicas} data-parallel replica(s)" in card


@pytest.mark.slow
def test_final_folder_of_a_pipeline_run_is_pushed_to_the_hub(runs, hub):
    """The consolidated folder (rank 0 gathers the stages) is what reaches the Hub, with its card."""
    from hftk.checkpoint.run_record import CARD_FILE
    from hftk.publish.hub import folder_files

    final = runs / "gpt2-dp" / "final"
    files = hub.state.files(REPO)
    assert set(files) == {".gitattributes", *folder_files(final)}
    assert files["model.safetensors"] == (final / "model.safetensors").read_bytes()
    assert "**pipeline** over 4 process(es), 2 data-parallel replica(s)" in files[CARD_FILE].decode()
    assert [m["hub_push"] for m in metrics(runs / "gpt2-dp") if "hub_push" in m] == ["ok"]


@pytest.mark.slow
def test_export_reloads_with_reference_eval_loss(runs, tmp_path):
    """`hftk export` of a per-stage checkpoint -> from_pretrained -> the Trainer's eval loss = the reference's."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

    from hftk.data.dataset import tokenize_and_pack
    from hftk.models.loading import load_tokenizer
    from hftk.publish.export import export
    from hftk.run.prepare import prepare

    assert export(runs / "gpt2-1f1b" / f"checkpoint-{STEPS}", tmp_path / "hf") == "pipeline"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.lm_head.weight is model.transformer.wte.weight
    prepared = prepare([*TINY_ARGS, "--model_name_or_path", MODELS["gpt2"], "--output_dir", str(tmp_path / "unused")])
    tokenizer = load_tokenizer(prepared.cfg.model)
    data = tokenize_and_pack(prepared.cfg.data, prepared.raw, tokenizer, prepared.data_format, 7)
    args = TrainingArguments(output_dir=str(tmp_path / "eval"), use_cpu=True, report_to="none",
                             per_device_eval_batch_size=8)
    got = Trainer(model=model, args=args, data_collator=default_data_collator).evaluate(data.eval)["eval_loss"]
    ref = [m["eval_loss"] for m in metrics(runs / "ref-gpt2") if "eval_loss" in m][-1]
    loop = [m["eval_loss"] for m in metrics(runs / "gpt2-1f1b") if "eval_loss" in m][-1]
    assert got == pytest.approx(ref, abs=1e-5)
    assert loop == pytest.approx(ref, abs=1e-5)


def test_cli_prints_one_line_and_exits_2(tmp_path):
    """gpt2-tiny has 2 blocks: 2 ranks x 2 virtual stages cannot be cut from it."""
    bad = python([str(FINETUNE), *TINY_ARGS, *PIPE, "--pp_schedule", "interleaved_1f1b",
               "--output_dir", str(tmp_path / "out2")], timeout=120, env={"WORLD_SIZE": "2"})
    lines = [x for x in bad.stderr.splitlines() if x.strip() and "Setting accelerator" not in x]
    assert bad.returncode == 2 and len(lines) == 1, bad.stderr
    assert lines[0].startswith("hftk: error: strategy.pp_virtual_stages:") and "Traceback" not in bad.output
