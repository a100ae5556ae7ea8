"""Config loading (YAML + overrides, help on every option) and the data pipeline (masking, packing)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hftk.config import SECTIONS, DataConfig, build_parser, load_config
from hftk.data import IGNORE_INDEX, check_raw, collator, eval_line, load_raw, tokenize_and_pack
from hftk.modeling import load_tokenizer
from hftk.config import ModelConfig


def test_yaml_sections_and_cli_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model: {model_name_or_path: builtin:gpt2-tiny}\n"
        "data: {block_size: 32}\n"
        "training: {learning_rate: 0.01, per_device_train_batch_size: 3}\n"
        "strategy: {strategy: ddp}\n"
    )
    cfg = load_config(["--config", str(path), "--block_size", "48"])
    assert cfg.model.model_name_or_path == "builtin:gpt2-tiny"
    assert cfg.data.block_size == 48  # command line wins over the file
    assert cfg.training["learning_rate"] == 0.01 and cfg.training["per_device_train_batch_size"] == 3
    assert load_config(cfg_args := ["--config", str(path)]).data.block_size == 32, cfg_args


def test_every_training_argument_passes_through():
    cfg = load_config(["--adam_beta2", "0.95", "--weight_decay", "0.1", "--optim", "adamw_torch"])
    assert cfg.training["adam_beta2"] == 0.95 and cfg.training["weight_decay"] == 0.1
    assert cfg.training["optim"] == "adamw_torch"


def test_every_option_has_help_text():
    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            assert len(f.metadata.get("help", "")) > 10, f"{cls.__name__}.{f.name} has no help"
    help_text = build_parser().format_help()
    assert "--strategy" in help_text and "--block_size" in help_text and "--learning_rate" in help_text


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig(model_name_or_path="builtin:gpt2-tiny"))


def test_pad_token_is_set_when_missing(tokenizer):
    assert tokenizer.pad_token is not None and tokenizer.pad_token == tokenizer.eos_token


def test_prompt_tokens_are_masked_exactly(tmp_path, tokenizer):
    example = {"prompt": "Question: who made the heaven?\nAnswer:", "completion": " God made the heaven."}
    (tmp_path / "pc.jsonl").write_text(json.dumps(example) + "\n")
    cfg = DataConfig(dataset=str(tmp_path / "pc.jsonl"), block_size=64, packing="none", eval_fraction=0)
    raw = load_raw(cfg)
    fmt = check_raw(cfg, raw)
    assert fmt == "prompt_completion"
    row = tokenize_and_pack(cfg, raw, tokenizer, fmt, seed=0).train[0]
    prompt_ids = tokenizer(example["prompt"], add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(example["completion"], add_special_tokens=False)["input_ids"]
    n_p, n_c = len(prompt_ids), len(completion_ids) + 1  # + eos
    labels, ids = row["labels"].tolist(), row["input_ids"].tolist()
    assert ids[:n_p] == prompt_ids
    assert labels[:n_p] == [IGNORE_INDEX] * n_p
    assert labels[n_p:n_p + n_c] == completion_ids + [tokenizer.eos_token_id]
    assert len(labels) == n_p + n_c  # one example per row, unpadded: the collator pads each batch
    batch = collator(cfg, tokenizer.pad_token_id, fixed_length=64)([row])
    assert batch["labels"][0, n_p + n_c:].tolist() == [IGNORE_INDEX] * (64 - n_p - n_c)  # padding is not trained on
    assert batch["attention_mask"][0].tolist() == [1] * (n_p + n_c) + [0] * (64 - n_p - n_c)


def test_packing_makes_full_blocks_and_holds_out_eval(tokenizer):
    cfg = DataConfig(block_size=32, packing="concat", max_train_samples=400, eval_fraction=0.1)
    raw = load_raw(cfg)
    data = tokenize_and_pack(cfg, raw, tokenizer, check_raw(cfg, raw), seed=0)
    assert len(data.train) > 10 and data.eval is not None and len(data.eval) > 0
    assert all(len(r) == 32 for r in data.train["input_ids"][:20])
    assert (data.train["labels"][:20] == data.train["input_ids"][:20]).all()


def test_max_eval_samples_caps_the_eval_blocks_after_the_split(tokenizer):
    def blocks(**cap):
        cfg = DataConfig(block_size=32, packing="concat", max_train_samples=400, eval_fraction=0.1, **cap)
        raw = load_raw(cfg)
        return cfg, tokenize_and_pack(cfg, raw, tokenizer, check_raw(cfg, raw), seed=0)

    _, full = blocks()
    cfg, capped = blocks(max_eval_samples=5)
    assert len(full.eval) > 5 and len(capped.eval) == 5
    assert capped.eval[:]["input_ids"].tolist() == full.eval[:5]["input_ids"].tolist()  # same split, first blocks
    assert capped.train[:]["input_ids"].tolist() == full.train[:]["input_ids"].tolist()  # training data untouched
    assert len(blocks(max_eval_samples=10**6)[1].eval) == len(full.eval)
    assert eval_line(cfg, 5, 2, 2) == ("hftk: evaluation: 5 blocks of 32 tokens, 2 batches of 2 per rank over 2 "
                                       "data-parallel rank(s) per evaluation (capped by data.max_eval_samples=5)")
    assert "1 batches of 8 per rank over 1" in eval_line(DataConfig(), 3, 8, 1)


@pytest.mark.parametrize("suffix,write", [
    ("txt", lambda p: p.write_text("line one of text\nline two of text\n")),
    ("csv", lambda p: p.write_text("text\nline one of text\nline two\n")),
    ("parquet", lambda p: __import__("datasets").Dataset.from_dict({"text": ["a b c", "d e f"]}).to_parquet(str(p))),
])
def test_local_file_formats(tmp_path, suffix, write):
    path = tmp_path / f"d.{suffix}"
    write(path)
    cfg = DataConfig(dataset=str(path))
    raw = load_raw(cfg)
    assert check_raw(cfg, raw) == "text" and len(raw["train"]) == 2
