"""The mesh strategies (tp / cp / sp: hftk/strategies/mesh.py and the strategies built on it) in one
process: their batch and ``loss_sum`` keep packed examples apart, and a layout they cannot run is one line
naming the field, before any process group."""

from __future__ import annotations

import pytest
import torch

from hftk.config.options import DataConfig
from hftk.data.chat import IGNORE_INDEX
from hftk.data.dataset import collator, rows
from tests.helpers import cpu_only_cases
from tests.unit.data.test_dataset import ATTENTION, FAMILIES, assert_examples_apart, dataset, examples

LLAMA = ["--model_name_or_path", "builtin:llama-tiny"]
GPT2 = ["--model_name_or_path", "builtin:gpt2-tiny"]


@pytest.fixture()
def config_folders(tmp_path):
    """Model configs (no weights: validation reads only the config) hftk must refuse for some layouts."""
    from transformers import MistralConfig, OPTConfig

    OPTConfig(vocab_size=2048, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
              max_position_embeddings=256).save_pretrained(tmp_path / "opt")
    MistralConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, sliding_window=32).save_pretrained(tmp_path / "mistral")
    return {"opt": tmp_path / "opt", "mistral": tmp_path / "mistral"}


ERRORS = [
    # (id, WORLD_SIZE, args, field named, words the message must contain)
    ("mesh_not_world", 2, ["--strategy", "tp", "--tp_size", "2", "--dp_shard_size", "2"], "strategy.tp_size", "world size"),
    ("heads_not_divisible", 3, [*LLAMA, "--strategy", "tp", "--tp_size", "3"], "strategy.tp_size", "heads"),
    ("no_plan", 2, ["--model_name_or_path", "{opt}", "--strategy", "tp", "--tp_size", "2"],
     "model.model_name_or_path", "'opt'"),
    ("tp_with_sp", 4, [*LLAMA, "--strategy", "tp", "--tp_size", "2", "--sp_size", "2"], "strategy.sp_size", "strategy tp"),
    ("sp_with_tp", 4, [*LLAMA, "--strategy", "sp", "--sp_size", "2", "--tp_size", "2"], "strategy.tp_size", "strategy sp"),
    ("tp_size_needs_tp", 2, ["--tp_size", "2"], "strategy.tp_size", "--strategy tp"),
    ("cp_size_needs_cp", 2, ["--cp_size", "2"], "strategy.cp_size", "--strategy cp"),
    ("cp_size_one", 1, [*LLAMA, "--strategy", "cp"], "strategy.cp_size", "2 or more"),
    ("cp_mesh_not_world", 4, [*LLAMA, "--strategy", "cp", "--cp_size", "2", "--tp_size", "4"], "strategy.cp_size",
     "world size"),
    ("cp_block", 2, [*LLAMA, "--strategy", "cp", "--cp_size", "2", "--block_size", "66"], "data.block_size",
     "4 equal chunks"),
    *cpu_only_cases(("cp_dropout_on_cpu", 2, [*LLAMA, "--strategy", "cp", "--cp_size", "2", "--model_dropout", "0.1"],
                     "model.model_dropout", "dropout")),
    ("cp_padding", 2, [*LLAMA, "--strategy", "cp", "--cp_size", "2", "--packing", "none"], "data.packing",
     "padding"),
    ("cp_eager", 2, [*LLAMA, "--strategy", "cp", "--cp_size", "2", "--attn_implementation", "eager"],
     "model.attn_implementation", "sdpa"),
    ("cp_sliding_window", 2, ["--model_name_or_path", "{mistral}", "--strategy", "cp", "--cp_size", "2"],
     "model.model_name_or_path", "sliding_attention"),
    ("tp_unsupported_option", 2, [*LLAMA, "--strategy", "tp", "--tp_size", "2", "--torch_compile"],
     "training.torch_compile", "supported"),
    ("tp_lora", 2, [*LLAMA, "--strategy", "tp", "--tp_size", "2", "--lora_r", "8"], "model.lora_r", "LoRA"),
    ("tp_sync_check", 2, [*LLAMA, "--strategy", "tp", "--tp_size", "2", "--check_sync_steps", "1"],
     "tracking.check_sync_steps", "no replicas"),
    ("sp_sync_check", 2, [*LLAMA, "--strategy", "sp", "--sp_size", "2", "--check_sync_steps", "1"],
     "tracking.check_sync_steps", "no replicas"),
    ("sp_world", 3, [*LLAMA, "--strategy", "sp", "--sp_size", "2"], "strategy.sp_size", "world size"),
    ("sp_eager", 2, [*LLAMA, "--strategy", "sp", "--sp_size", "2", "--attn_implementation", "eager"],
     "model.attn_implementation", "sdpa"),
    ("sp_block", 2, [*LLAMA, "--strategy", "sp", "--sp_size", "2", "--block_size", "63"], "data.block_size", "63"),
]


@pytest.mark.parametrize("case_id,world,args,field,words", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_layouts_fail_in_one_line_before_any_process_group(case_id, world, args, field, words, config_folders,
                                                              tmp_path, monkeypatch, capsys):
    import torch.distributed as dist

    from hftk.run.prepare import main

    monkeypatch.setenv("WORLD_SIZE", str(world))
    out = tmp_path / "out"
    args = [a.format(**config_folders) for a in args]
    assert main(["--output_dir", str(out), *args]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "Setting accelerator" not in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"hftk: error: {field}:") and words in lines[0] and "Fix:" in lines[0], lines[0]
    assert not dist.is_initialized() and not out.exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_bfd_example_through_the_mesh_step_batch_equals_the_example_alone(family_models, family):
    """The mesh strategies' path (tp / cp / sp), in one process on the plain model (tp 1): their batch from
    the collator at block_size and their ``loss_sum``. The position ids must be the collator's (fails with 0.. per
    row); 2 ranks of tp then give this loop's losses (the slow test below)."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from hftk.strategies.mesh import loss_sum, model_batch, token_count

    model = AutoModelForCausalLM.from_pretrained(family_models[family],
                                                 attn_implementation=ATTENTION.get(family, "sdpa")).eval()
    items = examples(model.config.vocab_size)
    rows_ = rows(dataset(items), "bfd", 32, "prompt_completion")
    collate = collator(DataConfig(packing="bfd", block_size=32), pad_id=0, fixed_length=32)
    batch = model_batch(collate([rows_[i] for i in range(len(rows_))]), "cpu")
    assert set(batch) == {"input_ids", "position_ids", "shift_labels"} and batch["input_ids"].shape[1] == 32
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        loss = float(loss_sum(model, batch) / token_count(batch))
    labels = F.pad(batch["shift_labels"][:, :-1], (1, 0), value=IGNORE_INDEX)
    assert_examples_apart(model, items, {**batch, "labels": labels}, logits, loss)
