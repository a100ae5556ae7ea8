"""Pipeline parallelism: stages cut from the HF model's own structure, every schedule exact against
a plain PyTorch loop on one process (losses, gradient norms and weights, tied embeddings included),
pp x dp on 4 ranks, exact resume, export to a standard HF folder, and clear errors before any
process group.

The reference of each model is tests/reference/plain.py's loop (no hftk, no Trainer), with the
Trainer's fused AdamW and its loss divisor, which the pipeline engine follows: the Trainer counts
``num_items_in_batch`` as the predicted tokens for a model whose ``loss_type`` is ForCausalLM (Llama)
and as every label otherwise (GPT-2, 1/64 more at block size 64). Launches are shared
(``tests.helpers.finetune_cells``): one 2-rank launch running all three schedules of both models and
the resume, one 4-rank pp x dp launch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import (FINETUNE, TINY_ARGS, finetune_cells, load_weights, losses, max_weight_diff, metrics,
                           plain_reference, run)

STEPS = 5
MODELS = {"gpt2": "builtin:gpt2-tiny4", "llama": "builtin:llama-tiny"}
DIVISORS = {"gpt2": "labels", "llama": "targets"}  # the Trainer's num_items_in_batch for each (see above)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
COMMON = ["--max_steps", str(STEPS), "--per_device_train_batch_size", "8"]
PIPE = ["--strategy", "pipeline", "--pp_size", "2", "--pp_microbatches", "4"]
pytestmark = pytest.mark.timeout(1800)  # the first slow test launches every run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
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
                                   str(root / "gpt2-dp")]}, root)
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
    from hftk.run_record import CARD_FILE, RUN_FILE

    final = runs / folder / "final"
    record = json.loads((final / RUN_FILE).read_text())
    assert (record["world_size"], record["data_parallel_size"]) == (processes, replicas)
    hyper = record["hyperparameters"]
    assert hyper["global_batch_size"] == hyper["per_device_train_batch_size"] * replicas
    card = (final / CARD_FILE).read_text()
    assert f"**pipeline** over {processes} process(es), {replicas} data-parallel replica(s)" in card


@pytest.mark.slow
def test_export_reloads_with_reference_eval_loss(runs, tmp_path):
    """`hftk export` of a per-stage checkpoint -> from_pretrained -> the Trainer's eval loss = the reference's."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

    from hftk.data import tokenize_and_pack
    from hftk.export import export
    from hftk.modeling import load_tokenizer
    from hftk.run import prepare

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


# ---------------------------------------------------------------------------------------------
# In-process checks: no process group needed
# ---------------------------------------------------------------------------------------------

def _tiny_configs():
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig, MistralConfig, Qwen2Config

    small = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4)
    return {
        "gpt2": GPT2Config(vocab_size=128, n_layer=4, n_embd=32, n_head=4, n_positions=64, bos_token_id=0,
                           eos_token_id=0),
        "gpt_neox": GPTNeoXConfig(**small),
        "llama": LlamaConfig(**small, num_key_value_heads=2),
        "mistral": MistralConfig(**small, num_key_value_heads=2, sliding_window=8),
        "qwen2": Qwen2Config(**small, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                             max_window_layers=2),
    }


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "llama", "mistral", "qwen2"])
def test_stage_chain_equals_model_forward(family):
    """Stages called one after another give the model's own logits (padding mask, rotary, sliding window)."""
    from transformers import AutoModelForCausalLM

    from hftk.strategies.pipeline import build_stages

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_configs()[family]).eval()
    ids = torch.randint(0, 128, (3, 20))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        for n in (2, 3, 4):
            stages = build_stages(model, n)
            hidden = ids
            for stage in stages:
                hidden = stage(hidden, attention_mask=mask)
            assert torch.equal(hidden, ref), n
            names = [k for s in stages for k in s.full_state_dict()]
            assert sorted(names) == sorted(model.state_dict()) and len(names) == len(set(names))


def test_split_balances_parameters():
    from hftk.strategies.pipeline import split_blocks

    assert split_blocks([10] * 4, head=0, tail=0, n_stages=2) == [range(0, 2), range(2, 4)]
    # heavy embeddings: the first stage takes fewer blocks
    assert split_blocks([10] * 8, head=25, tail=0, n_stages=2) == [range(0, 3), range(3, 8)]
    assert split_blocks([10] * 8, head=30, tail=30, n_stages=2) == [range(0, 4), range(4, 8)]
    assert [len(r) for r in split_blocks([1] * 5, head=0, tail=0, n_stages=5)] == [1] * 5
    with pytest.raises(ValueError):
        split_blocks([1] * 3, head=0, tail=0, n_stages=4)


def _opt_folder(tmp: Path) -> Path:
    from transformers import OPTConfig

    folder = tmp / "opt"
    OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=4, ffn_dim=64, num_attention_heads=4).save_pretrained(folder)
    return folder


def _resume_folder(tmp: Path) -> Path:
    from hftk.checkpoint import seal

    ckpt = tmp / "out-resume" / "checkpoint-3"
    ckpt.mkdir(parents=True)
    (ckpt / "pipeline.json").write_text(json.dumps({"pp_size": 2, "dp_size": 1, "num_stages": 2}))
    seal(ckpt, 3)
    return tmp / "out-resume"


ERRORS = [
    # (id, world size, args, field named)
    ("one_stage", 2, ["--pp_size", "1"], "strategy.pp_size"),
    ("pp_size_without_pipeline", 2, ["--strategy", "ddp"], "strategy.pp_size"),
    ("world_not_multiple", 3, [], "strategy.pp_size"),
    ("microbatches_not_dividing", 2, ["--pp_microbatches", "3"], "strategy.pp_microbatches"),
    ("1f1b_too_few_microbatches", 2, ["--pp_microbatches", "1"], "strategy.pp_microbatches"),
    ("interleaved_rounds", 2, ["--pp_schedule", "interleaved_1f1b", "--pp_microbatches", "5",
                               "--per_device_train_batch_size", "10"], "strategy.pp_microbatches"),
    ("more_stages_than_layers", 4, ["--model_name_or_path", "builtin:gpt2-tiny", "--pp_size", "4"], "strategy.pp_size"),
    ("interleaved_too_few_layers", 2, ["--model_name_or_path", "builtin:gpt2-tiny", "--pp_schedule", "interleaved_1f1b"],
     "strategy.pp_virtual_stages"),
    ("interleaved_one_virtual", 2, ["--pp_schedule", "interleaved_1f1b", "--pp_virtual_stages", "1"],
     "strategy.pp_virtual_stages"),
    ("unsupported_architecture", 2, ["--model_name_or_path", "{opt}"], "'opt'"),
    ("with_tp", 4, ["--tp_size", "2"], "strategy.tp_size"),
    ("with_fsdp_sharding", 4, ["--dp_shard_size", "2"], "strategy.dp_shard_size"),
    ("with_zero3", 2, ["--deepspeed", "{tmp}/ds.json"], "training.deepspeed"),
    ("with_fsdp", 2, ["--fsdp", "full_shard"], "training.fsdp"),
    ("with_compression", 2, ["--grad_compression", "fp16"], "strategy.grad_compression"),
    ("resume_other_layout", 4, ["--output_dir", "{resume}", "--resume_from_checkpoint", "latest"],
     "training.resume_from_checkpoint"),
]


@pytest.mark.parametrize("case_id,world,args,needle", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_pipeline_config_is_named_before_any_process_group(case_id, world, args, needle, tmp_path, monkeypatch):
    import torch.distributed as dist

    from hftk.errors import HftkError
    from hftk.run import prepare

    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    subs = {"{tmp}": str(tmp_path), "{opt}": str(_opt_folder(tmp_path)) if case_id == "unsupported_architecture" else "",
            "{resume}": str(_resume_folder(tmp_path)) if case_id == "resume_other_layout" else ""}
    args = [next((a.replace(k, v) for k, v in subs.items() if k in a), a) for a in args]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(HftkError) as err:
        prepare([*TINY_ARGS, "--model_name_or_path", MODELS["gpt2"], *PIPE, "--output_dir", str(tmp_path / "out"),
                 *args])
    assert needle in err.value.one_line() and "Fix:" in err.value.one_line()
    assert not dist.is_initialized()
    assert not (tmp_path / "out").exists()


def test_cli_prints_one_line_and_exits_2(tmp_path):
    """gpt2-tiny has 2 blocks: 2 ranks x 2 virtual stages cannot be cut from it."""
    bad = run([sys.executable, str(FINETUNE), *TINY_ARGS, *PIPE, "--pp_schedule", "interleaved_1f1b",
               "--output_dir", str(tmp_path / "out2")], timeout=120, env={"WORLD_SIZE": "2"})
    lines = [x for x in bad.stderr.splitlines() if x.strip() and "Setting accelerator" not in x]
    assert bad.returncode == 2 and len(lines) == 1, bad.stderr
    assert lines[0].startswith("hftk: error: strategy.pp_virtual_stages:") and "Traceback" not in bad.output


def _gpipe_trace(p: int, m: int, f: float, b: float) -> list[list[list]]:
    """What torch's GPipe runs on each rank: all forwards, then all backwards, micro-batch order."""
    return [[["F", r, i, 0, 0, f] for i in range(m)] + [["B", r, i, 0, 0, b] for i in range(m)] for r in range(p)]


def test_bench_replay_recovers_theory_and_wall_counts_idle():
    from hftk.bench.pipeline import replay, theory, wall_bubble

    for p, m in ((2, 1), (2, 4), (4, 8)):
        assert replay(_gpipe_trace(p, m, 1.0, 2.0), p) == pytest.approx(theory("gpipe", m, p, 1))
    assert theory("interleaved_1f1b", 4, 2, 2) == pytest.approx(1 / 9)
    assert theory("interleaved_1f1b", 1, 2, 2) == pytest.approx(0.5)  # one micro-batch cannot overlap its chunks
    # the loss is charged to the last stage's forward: 1 + 0.5 per micro-batch there
    trace = _gpipe_trace(2, 2, 1.0, 2.0)
    trace[1][1:1] = [["L", 1, 0, 0, 0, 0.5]]
    trace[1][3:3] = [["L", 1, 1, 0, 0, 0.5]]
    assert replay(trace, 2) == pytest.approx(1 - (6 + 7) / (2 * 10.0))  # makespan 1 + 2 x 1.5 + 2 x 2 + 2
    steps = [{"start": 0.0, "end": 10.0, "events": [["F", 0, 0, 0.0, 4.0, 4.0]]},
             {"start": 0.0, "end": 10.0, "events": [["F", 1, 0, 4.0, 10.0, 6.0]]}]
    assert wall_bubble(steps) == pytest.approx(0.5)
