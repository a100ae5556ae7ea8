"""The data pipeline (hftk.data.dataset) through ``hftk.run.prepare.prepare``: conversational and instruction formats
(detection, conversion, bad rows, long conversations, several datasets, bad input in one line), and
plain text and prompt/completion files (pad token, prompt masking, packing with a held-out eval split,
local file formats)."""

from __future__ import annotations

import json

import pytest
import torch

from hftk.config.options import DataConfig, ModelConfig
from hftk.data.chat import IGNORE_INDEX
from hftk.data.dataset import check_raw, collator, eval_line, load_raw, rows, tokenize_and_pack, tokenize_sources
from hftk.models.loading import load_tokenizer
from hftk.models.support_table import MATRIX_FAMILIES
from hftk.run.prepare import prepare

TINY = ["--model_name_or_path", "builtin:gpt2-tiny", "--block_size", "256", "--eval_fraction", "0"]
# One conversation per row (packing none) so rows can be read one by one; bfd is the packing section's below.
CHAT = [*TINY, "--chat_template", "chatml", "--packing", "none"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return str(path)


def chat_row(user="Wer schuf den Himmel?", answer="Gott schuf ihn, sagt die Schrift.", system=None, turns=1):
    messages = [{"role": "system", "content": system}] if system else []
    for i in range(turns):
        messages += [{"role": "user", "content": f"{user} ({i})"}, {"role": "assistant", "content": f"{answer} {i}"}]
    return {"messages": messages}


def blocks(args, tmp_path):
    p = prepare([*args, "--output_dir", str(tmp_path / "out")])
    tokenizer = load_tokenizer(p.cfg.model, p.cfg.data.chat_template)
    return p, tokenizer, tokenize_sources(p.sources, tokenizer, 0).train


def labelled_text(tokenizer, row) -> str:
    ids = [t for t, lab in zip(row["input_ids"].tolist(), row["labels"].tolist()) if lab != IGNORE_INDEX]
    return tokenizer.decode(ids)


def test_messages_are_detected_padded_per_batch_and_labelled_on_assistant_turns(tmp_path):
    from hftk.data.dataset import collator

    data = write_jsonl(tmp_path / "chat.jsonl", [chat_row(system="Sei kurz.", turns=2), chat_row(answer="Ja — 是的.")])
    p, tokenizer, train = blocks([*CHAT, "--dataset", data], tmp_path)
    assert p.data_format == "messages" and len(train) == 2  # never packed across conversations
    assert labelled_text(tokenizer, train[0]) == "Gott schuf ihn, sagt die Schrift. 0<|im_end|>Gott schuf ihn, sagt die Schrift. 1<|im_end|>"
    assert labelled_text(tokenizer, train[1]) == "Ja — 是的. 0<|im_end|>"
    batch = collator(p.cfg.data, tokenizer.pad_token_id)([train[0], train[1]])
    assert batch["input_ids"].shape[1] == len(train[0]["input_ids"]) < 256  # padded to the batch's longest
    assert batch["attention_mask"][1].sum() == len(train[1]["input_ids"])  # padding unlabelled
    assert (batch["labels"][1][batch["attention_mask"][1] == 0] == IGNORE_INDEX).all()


@pytest.mark.parametrize("multiple", [None, 8, 64])
def test_unpacked_rows_are_padded_exactly_as_trls_collator_pads_them(multiple):
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    rows_ = [{"input_ids": torch.arange(3, 3 + n), "labels": torch.tensor([IGNORE_INDEX] * 2 + list(range(n - 2)))}
             for n in (5, 11, 2 + 1)]
    cfg = DataConfig(packing="none", pad_to_multiple_of=multiple)
    got = collator(cfg, pad_id=0)(rows_)
    want = DataCollatorForLanguageModeling(pad_token_id=0, pad_to_multiple_of=multiple)(
        [{k: v.tolist() for k, v in r.items()} for r in rows_])
    assert list(got) == list(want)  # the same keys, in the same order
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


def test_train_on_prompt_labels_the_prompt_turns(tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", [chat_row(system="Sei kurz.")])
    _, tokenizer, train = blocks([*CHAT, "--dataset", data, "--train_on_prompt"], tmp_path)
    assert labelled_text(tokenizer, train[0]).startswith("<|im_start|>system\nSei kurz.")


def test_sharegpt_is_converted_to_messages(tmp_path):
    rows = [{"conversations": [{"from": "system", "value": "Sei kurz."}, {"from": "human", "value": "Hallo?"},
                               {"from": "gpt", "value": "Grüß Gott."}]}]
    p, tokenizer, train = blocks([*CHAT, "--dataset", write_jsonl(tmp_path / "sg.jsonl", rows)], tmp_path)
    assert p.data_format == "messages"
    assert p.raw["train"][0]["messages"][1] == {"role": "user", "content": "Hallo?"}
    assert labelled_text(tokenizer, train[0]) == "Grüß Gott.<|im_end|>"


def test_alpaca_becomes_prompt_completion_without_a_template_and_messages_with_one(tmp_path):
    rows = [{"instruction": "Translate.", "input": "Himmel", "output": "heaven"}, {"instruction": "Say hi.", "output": "hi"}]
    data = write_jsonl(tmp_path / "alpaca.jsonl", rows)
    p, tokenizer, train = blocks([*TINY, "--dataset", data, "--packing", "none"], tmp_path)
    assert p.data_format == "prompt_completion"
    assert "### Input:\nHimmel" in p.raw["train"][0]["prompt"] and "### Input" not in p.raw["train"][1]["prompt"]
    assert labelled_text(tokenizer, train[0]) == "heaven" + tokenizer.eos_token
    p, tokenizer, train = blocks([*CHAT, "--dataset", data], tmp_path)
    assert p.data_format == "messages" and p.raw["train"][0]["messages"][0]["content"] == "Translate.\n\nHimmel"
    assert labelled_text(tokenizer, train[1]) == "hi<|im_end|>"


def test_bad_rows_are_dropped_with_one_summary_line(tmp_path, capsys):
    rows = [chat_row(), {"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}]},
            {"messages": [{"role": "user", "content": "x"}]}, chat_row(answer="Amen.")]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    p = prepare([*CHAT, "--dataset", data, "--on_bad_row", "drop", "--output_dir", str(tmp_path / "o")])
    assert len(p.raw["train"]) == 2
    out = [line for line in capsys.readouterr().out.splitlines() if "dropped" in line]
    assert len(out) == 1 and "dropped 2 of 4 rows" in out[0] and "unknown role" in out[0]


@pytest.mark.parametrize("mode,kept", [("drop", 1), ("truncate", 2)])
def test_long_conversations_dropped_or_truncated_to_whole_turns(tmp_path, capsys, mode, kept):
    long = chat_row()  # a first exchange that fits, then three that do not
    long["messages"] += chat_row(user="Tell it long " * 20, answer="So be it " * 10, turns=3)["messages"]
    data = write_jsonl(tmp_path / "chat.jsonl", [chat_row(), long])
    _, tokenizer, train = blocks([*CHAT, "--dataset", data, "--truncation", mode, "--block_size", "160"], tmp_path)
    assert len(train) == kept
    summary = [line for line in capsys.readouterr().out.splitlines() if "longer than block_size" in line]
    assert len(summary) == 1 and ("dropped 1 of 2" if mode == "drop" else "truncated 1, dropped 0 of 2") in summary[0]
    if mode == "truncate":
        text = labelled_text(tokenizer, train[1])
        assert text and text.endswith("<|im_end|>")  # every labelled turn keeps its end token
        assert text.count("<|im_end|>") < 4


def test_a_split_whose_every_conversation_is_dropped_is_named_not_a_traceback(tmp_path, capsys):
    """Train all too long: the one-line block_size error. Held-out split all too long: no evaluation."""
    from hftk.core.errors import HftkError

    long = chat_row(user="Tell it long " * 20, answer="So be it " * 10, turns=3)
    folder = tmp_path / "chat"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [long, long])
    with pytest.raises(HftkError) as err:
        blocks([*CHAT, "--dataset", str(folder), "--truncation", "drop", "--block_size", "160"], tmp_path)
    assert err.value.field == "data.block_size"
    write_jsonl(folder / "train.jsonl", [chat_row(), chat_row(answer="Ja.")])
    write_jsonl(folder / "test.jsonl", [long])
    p = prepare([*CHAT, "--dataset", str(folder), "--eval_split", "test", "--truncation", "drop", "--block_size",
                 "160", "--output_dir", str(tmp_path / "out2")])
    data = tokenize_sources(p.sources, load_tokenizer(p.cfg.model, p.cfg.data.chat_template), 0)
    assert len(data.train) == 2 and data.eval is None
    assert "[eval]: dropped 1 of 1 conversations" in capsys.readouterr().out


def test_several_datasets_concatenated_or_interleaved_and_recorded(tmp_path):
    from hftk.checkpoint.run_record import model_card, run_record

    a = write_jsonl(tmp_path / "a.jsonl", [chat_row(answer=f"A{i}.") for i in range(6)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"In the beginning {i} was the word."} for i in range(6)])
    p, _, train = blocks([*CHAT, "--dataset", f"{a},{b}"], tmp_path)
    assert p.data_format == "messages+text" and len(train) == 12
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text(f"data:\n  datasets:\n    - {{path: {a}, weight: 3}}\n    - {{path: {b}, format: text, weight: 1}}\n")
    p, _, train = blocks([*CHAT, "--config", str(yaml_path)], tmp_path)
    p2, _, train2 = blocks([*CHAT, "--config", str(yaml_path)], tmp_path)
    assert [s.weight for s in p.sources] == [3.0, 1.0]
    rows = [r["input_ids"].tolist() for r in train]
    assert rows == [r["input_ids"].tolist() for r in train2]  # seeded
    from_a = sum(r["labels"][0].item() == IGNORE_INDEX for r in train)  # text rows are labelled from token 0
    assert 0 < len(rows) - from_a < from_a  # both mixed, the heavier one more often
    args = type("A", (), {k: 1 for k in ("per_device_train_batch_size", "gradient_accumulation_steps")})()
    from hftk.checkpoint.run_record import HYPERPARAMETERS
    for k in HYPERPARAMETERS:
        setattr(args, k, 1)
    record = run_record(p.cfg, args, 1, p.data_format, 0)
    assert [d["path"] for d in record["datasets"]] == [a, b] and record["datasets"][0]["weight"] == 3
    card = model_card(record, None)
    assert f"`{a}`" in card and f"`{b}`" in card and "weight 3" in card


@pytest.fixture()
def files(tmp_path):
    ok = chat_row()
    write_jsonl(tmp_path / "chat.jsonl", [ok])
    write_jsonl(tmp_path / "role.jsonl", [ok, {"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}]}])
    write_jsonl(tmp_path / "empty_answer.jsonl", [{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " "}]}])
    write_jsonl(tmp_path / "no_answer.jsonl", [ok, ok, {"messages": [{"role": "user", "content": "x"}]}])
    write_jsonl(tmp_path / "tool.jsonl", [{"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "42"},
                                                        {"role": "assistant", "content": "y"}]}])
    write_jsonl(tmp_path / "starts.jsonl", [{"messages": [{"role": "assistant", "content": "y"}]}])
    write_jsonl(tmp_path / "sharegpt.jsonl", [{"conversations": [{"from": "human", "value": "x"}, {"from": "bot", "value": "y"}]}])
    write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "x", "output": ""}])
    write_jsonl(tmp_path / "text.jsonl", [{"text": "some text"}])
    write_jsonl(tmp_path / "all_bad.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    (tmp_path / "key.yaml").write_text(f"data:\n  datasets:\n    - {{path: {tmp_path}/chat.jsonl, colour: red}}\n")
    (tmp_path / "weight.yaml").write_text(f"data:\n  datasets:\n    - {tmp_path}/chat.jsonl\n    - {{path: {tmp_path}/chat.jsonl, weight: -1}}\n")
    (tmp_path / "nopath.yaml").write_text("data:\n  datasets:\n    - {split: train}\n")
    (tmp_path / "both.yaml").write_text(f"data:\n  dataset: {tmp_path}/text.jsonl\n  datasets: [{tmp_path}/chat.jsonl]\n")
    (tmp_path / "fmt.yaml").write_text(f"data:\n  datasets:\n    - {{path: {tmp_path}/chat.jsonl, format: chat}}\n")
    return tmp_path


BAD = [
    # (id, args, text the one line must contain)
    ("unknown_role", ["--dataset", "{tmp}/role.jsonl", "--chat_template", "chatml"], "data.dataset: row 1 "),
    ("empty_assistant", ["--dataset", "{tmp}/empty_answer.jsonl", "--chat_template", "chatml"], "empty assistant turn"),
    ("no_final_answer", ["--dataset", "{tmp}/no_answer.jsonl", "--chat_template", "chatml"], "row 2 "),
    ("tool_turn", ["--dataset", "{tmp}/tool.jsonl", "--chat_template", "chatml"], "tool turn"),
    ("starts_with_assistant", ["--dataset", "{tmp}/starts.jsonl", "--chat_template", "chatml"], "starts with an assistant"),
    ("no_template", ["--dataset", "{tmp}/chat.jsonl"], "data.chat_template: the tokenizer has no chat template"),
    ("unknown_template", ["--dataset", "{tmp}/chat.jsonl", "--chat_template", "vicuna"], "data.chat_template"),
    ("messages_on_text", ["--dataset", "{tmp}/text.jsonl", "--data_format", "messages"], "data.messages_field"),
    ("sharegpt_missing", ["--dataset", "{tmp}/chat.jsonl", "--data_format", "sharegpt"], "data.conversations_field"),
    ("messages_field_missing", ["--dataset", "{tmp}/chat.jsonl", "--data_format", "messages", "--messages_field", "chat"],
     "data.messages_field"),
    ("sharegpt_bad_role", ["--dataset", "{tmp}/sharegpt.jsonl", "--chat_template", "chatml"], "unknown role 'bot'"),
    ("alpaca_empty_output", ["--dataset", "{tmp}/alpaca.jsonl"], "the output is empty"),
    ("all_dropped", ["--dataset", "{tmp}/all_bad.jsonl", "--chat_template", "chatml", "--on_bad_row", "drop"],
     "every row"),
    ("unknown_entry_key", ["--config", "{tmp}/key.yaml"], "data.datasets[0].colour"),
    ("bad_weight", ["--config", "{tmp}/weight.yaml"], "data.datasets[1].weight"),
    ("entry_without_path", ["--config", "{tmp}/nopath.yaml"], "data.datasets[0]: needs a path"),
    ("dataset_and_datasets", ["--config", "{tmp}/both.yaml"], "data.datasets"),
    ("entry_bad_format", ["--config", "{tmp}/fmt.yaml"], "data.datasets[0].format"),
    ("bad_on_bad_row", ["--on_bad_row", "skip"], "--on_bad_row"),
    ("bad_truncation", ["--truncation", "cut"], "--truncation"),
]


@pytest.mark.parametrize("case_id,args,text", BAD, ids=[c[0] for c in BAD])
def test_bad_chat_input_is_one_clear_line(case_id, args, text, files, capsys):
    import torch.distributed as dist

    from hftk.run.prepare import main

    out = files / "out"
    args = [a.replace("{tmp}", str(files)) for a in args]
    assert main([*TINY, "--output_dir", str(out), *args]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "Setting accelerator" not in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("hftk: error: ") and text in lines[0] and "Fix:" in lines[0], lines[0]
    assert not dist.is_initialized() and not out.exists()


def test_help_documents_every_new_option():
    from hftk.config.options import build_parser

    text = build_parser().format_help()
    for option in ("--data_format", "--datasets", "--messages_field", "--conversations_field", "--instruction_field",
                   "--input_field", "--output_field", "--chat_template", "--train_on_prompt", "--on_bad_row",
                   "--truncation"):
        assert option in text, option
    assert "sharegpt" in text and "interleave_datasets" in text


def test_preprocess_once_then_read_on_every_rank_or_refused_by_name(tmp_path, capsys):
    from hftk.cli import main as hftk

    data = write_jsonl(tmp_path / "chat.jsonl", [chat_row(turns=1 + i % 3) for i in range(6)])
    args = [*CHAT, "--dataset", data, "--output_dir", str(tmp_path / "out")]
    folder = tmp_path / "tok"
    assert hftk(["preprocess", *args, "--tokenized_path", str(folder)]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("hftk: preprocess:")]
    assert len(line) == 1 and "train: 6 blocks" in line[0]
    p = prepare([*args, "--tokenized_path", str(folder)])
    assert p.sources == [] and p.raw is None and p.data_format == "messages"
    _, _, fresh = blocks([*args], tmp_path)
    assert [r.tolist() for r in p.tokenized.train["labels"]] == [r.tolist() for r in fresh["labels"]]
    capsys.readouterr()
    # refused: the folder exists, another block size / template, not a tokenized folder
    for extra, text in [(["preprocess", *args, "--tokenized_path", str(folder)], "already exists"),
                        (["train", *args, "--tokenized_path", str(folder), "--block_size", "128"], "block_size"),
                        (["train", *args, "--tokenized_path", str(folder), "--chat_template",
                          str(tmp_path / "t.jinja")], "chat_template"),
                        (["train", *args, "--tokenized_path", str(tmp_path)], "not a folder written by hftk preprocess")]:
        (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
        assert hftk(extra) == 2
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(err) == 1 and "data.tokenized_path" in err[0] and text in err[0], err


def test_context_parallel_refuses_conversations(files, monkeypatch, capsys):
    """cp needs full blocks; conversations are padded one per block: refused before any process group."""
    from hftk.run.prepare import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    out = files / "out"
    assert main(["--model_name_or_path", "builtin:llama-tiny", "--strategy", "cp", "--cp_size", "2", "--output_dir",
                 str(out), "--dataset", str(files / "chat.jsonl"), "--chat_template", "chatml"]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip() and "Setting accelerator" not in x]
    assert len(err) == 1 and err[0].startswith("hftk: error: data.data_format: context parallel") and "Fix:" in err[0]
    assert not out.exists()


def test_only_the_splits_the_run_reads_are_checked(tmp_path):
    import datasets

    folder = tmp_path / "hubish"
    bad = {"messages": [[{"role": "user", "content": "x"}]]}  # no assistant turn: bad, but in an unused split
    datasets.DatasetDict({"train": datasets.Dataset.from_list([chat_row()]),
                          "test": datasets.Dataset.from_dict(bad)}).save_to_disk(str(folder))
    for split in ("train", "test"):
        datasets.load_from_disk(str(folder))[split].to_json(str(tmp_path / "hub" / f"{split}.jsonl"))
    p = prepare([*CHAT, "--dataset", str(tmp_path / "hub"), "--output_dir", str(tmp_path / "o")])
    assert list(p.raw) == ["train"] and len(p.raw["train"]) == 1


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


@pytest.mark.parametrize("packing", ["none", "bfd"])
@pytest.mark.parametrize("mode", ["drop", "truncate"])
def test_long_prompt_completion_pairs_are_dropped_or_cut_with_a_summary(tmp_path, capsys, tokenizer, mode, packing):
    """A pair longer than block_size is dropped (counted) or cut to the block with the summary saying its completion
    lost its end; a pair whose prompt alone fills the block is never trained with no completion token."""
    fits = {"prompt": "Who made the heaven?", "completion": " God."}
    long = {"prompt": "Who made the heaven?", "completion": " God made it" + " and it was good" * 20}
    prompt_only = {"prompt": "Tell me " * 40, "completion": " No."}
    (tmp_path / "pc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [fits, long, prompt_only]))
    cfg = DataConfig(dataset=str(tmp_path / "pc.jsonl"), block_size=32, packing=packing, eval_fraction=0,
                     truncation=mode)
    raw = load_raw(cfg)
    train = tokenize_and_pack(cfg, raw, tokenizer, check_raw(cfg, raw), seed=0).train
    summary = [line for line in capsys.readouterr().out.splitlines() if "longer than block_size 32" in line]
    assert len(summary) == 1, summary
    labels = [lab for row in train for lab in row["labels"].tolist() if lab != IGNORE_INDEX]
    fits_labels = tokenizer(fits["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    if mode == "drop":
        assert "dropped 2 of 3 prompt/completion pairs" in summary[0]
        assert labels == fits_labels
        return
    assert "truncated 1 (their completions cut short, without EOS), dropped 1 (prompt fills the block" in summary[0]
    assert "of 3 prompt/completion pairs" in summary[0]
    prompt_len = len(tokenizer(long["prompt"], add_special_tokens=False)["input_ids"])
    cut = tokenizer(long["completion"], add_special_tokens=False)["input_ids"][:32 - prompt_len]
    assert sorted(labels) == sorted(fits_labels + cut)  # the long pair's completion up to the block, no EOS
    assert labels.count(tokenizer.eos_token_id) == 1
    assert all(len(row["input_ids"]) <= 32 for row in train)


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


# ---------------------------------------------------------------- packing that keeps examples apart (bfd)
# In-process on small models of every family made from their default configs (the ``family_models`` fixture,
# tests/unit/conftest.py): the logits of an example packed among others by best-fit decreasing equal those of
# the same example run alone, and the packed loss equals the token-weighted mean of the examples' own losses;
# dynamic padding (``none``) gives the block-padded loss. The same checks through the pipeline stages and the
# mesh step's batch: tests/unit/strategies/test_pipeline.py, test_mesh.py.

# gpt-oss builds its masks without the position ids: it cannot keep packed examples apart, and hftk refuses bfd
# for it (test_a_model_whose_masks_ignore_position_ids_is_never_packed below)
FAMILIES = tuple(f for f in MATRIX_FAMILIES if f != "gpt_oss")
ATTENTION: dict[str, str] = {}  # families whose attention needs another implementation than sdpa


LENGTHS = (5, 31, 12, 3, 20, 9, 17, 2, 26, 8)  # whole examples, block 32: several share a block


def examples(vocab: int, prompt: int = 0) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in LENGTHS:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * min(prompt, n - 1) + ids[min(prompt, n - 1):]})
    return out


def dataset(items: list[dict[str, list[int]]]):
    import datasets

    return datasets.Dataset.from_list(items)


def alone(model, ex: dict[str, list[int]]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Logits, summed loss and labelled-token count of one example run by itself (no padding, no mask)."""
    ids = torch.tensor([ex["input_ids"]])
    logits = model(input_ids=ids, use_cache=False).logits[0]
    labels = torch.tensor(ex["labels"][1:])
    loss = torch.nn.functional.cross_entropy(logits[:-1], labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return logits, loss, int((labels != IGNORE_INDEX).sum())


def packed(vocab: int, attention: str | None = None, fixed_length: int | None = None
           ) -> tuple[list[dict[str, list[int]]], dict[str, torch.Tensor]]:
    """The examples (every token labelled: an example's first label must be dropped) and one bfd batch of
    all of them, as ``hftk.data.dataset.collator`` builds it for that attention / fixed length."""
    items = examples(vocab)
    cfg = DataConfig(packing="bfd", block_size=32)
    rows_ = rows(dataset(items), "bfd", 32, "prompt_completion")
    assert len(rows_) < len(items) and all(len(r) <= 32 for r in rows_["input_ids"])
    assert sorted(n for r in rows_["seq_lengths"] for n in r) == sorted(LENGTHS)  # every example whole
    batch = collator(cfg, pad_id=0, fixed_length=fixed_length, attention=attention)([rows_[i] for i in range(len(rows_))])
    assert "attention_mask" not in batch
    return items, batch


def assert_examples_apart(model, items: list[dict[str, list[int]]], batch: dict[str, torch.Tensor],
                          logits: torch.Tensor, loss: float | None = None) -> None:
    """Each example's slice of the packed ``logits`` equals ``model`` run on it alone (1e-5), pad tokens are
    segments of one with no label, and ``loss`` (when given) is the token mean of the examples' own losses."""
    by_ids = {tuple(e["input_ids"]): e for e in items}
    total, count, seen = 0.0, 0, 0
    for row in range(batch["input_ids"].shape[0]):
        starts = (batch["position_ids"][row] == 0).nonzero().flatten().tolist() + [batch["input_ids"].shape[1]]
        for start, end in zip(starts, starts[1:]):
            ex = by_ids.get(tuple(batch["input_ids"][row, start:end].tolist()))
            if ex is None:  # a pad token: its own segment, nothing learned from it
                assert end - start == 1 and batch["labels"][row, start] == IGNORE_INDEX
                continue
            alone_logits, alone_loss, n = alone(model, ex)
            torch.testing.assert_close(logits[row, start:end], alone_logits, atol=1e-5, rtol=0)
            total, count, seen = total + alone_loss, count + n, seen + 1
    assert seen == len(items)
    assert count == int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())  # no label predicts a next example
    if loss is not None:
        assert loss == pytest.approx(total.item() / count, abs=1e-5)


# sdpa for every family; eager where the attention code differs most (GPT-2's own, Llama's shared one).
# Two layouts: the packed rows kept apart (sdpa / eager) and flattened into one row (what flash
# attention's varlen path needs; sdpa reads the same position ids there too).
@pytest.mark.parametrize("layout", ["rows", "flat"])
@pytest.mark.parametrize("family,attn", [*((f, ATTENTION.get(f, "sdpa")) for f in FAMILIES), ("gpt2", "eager"),
                                         ("llama", "eager")])
def test_bfd_example_equals_the_example_alone(family_models, family, attn, layout):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(family_models[family], attn_implementation=attn).eval()
    items, batch = packed(model.config.vocab_size, "flash_attention_2" if layout == "flat" else attn)
    if layout == "flat":
        assert batch["input_ids"].shape == (1, sum(LENGTHS))  # one padding-free row
    else:
        assert batch["input_ids"].shape[0] > 1 and batch["input_ids"].shape[1] <= 32  # rows apart, not flattened
    with torch.no_grad():
        out = model(**batch)  # eval mode: without use_cache=False a cache would join the examples
    assert_examples_apart(model, items, batch, out.logits, out.loss.item())


def test_dynamic_padding_gives_the_block_padded_loss_on_fewer_tokens(family_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(family_models["llama"]).eval()
    items = examples(model.config.vocab_size, prompt=2)
    per_row = rows(dataset(items), "none", 32, "prompt_completion")
    cfg = DataConfig(packing="none", block_size=32, pad_to_multiple_of=8)
    losses, tokens = {}, {}
    for name, collate in {"dynamic": collator(cfg, pad_id=0), "block": collator(cfg, pad_id=0, fixed_length=32)}.items():
        total = count = computed = 0
        for start in range(0, len(per_row), 4):  # batches of 4: lengths 5..31
            batch = collate([per_row[i] for i in range(start, min(start + 4, len(per_row)))])
            n = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
            with torch.no_grad():
                total, count = total + model(**batch).loss.item() * n, count + n
            computed += batch["input_ids"].numel()
            assert batch["input_ids"].shape[1] % 8 == 0
        losses[name], tokens[name] = total / count, computed
    assert losses["dynamic"] == pytest.approx(losses["block"], abs=1e-6)
    assert tokens["dynamic"] < tokens["block"] == 32 * len(LENGTHS)


def test_a_model_whose_masks_ignore_position_ids_is_never_packed(tmp_path, monkeypatch):
    """gpt-oss builds its masks without the position ids, so examples packed into a row would attend to each other:
    bfd is refused by name and auto gives one conversation per row."""
    import json

    from hftk.core.errors import HftkError
    from tests.helpers import make_family

    model = make_family("gpt_oss", tmp_path / "gpt_oss")
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Q{i}?"},
                                                     {"role": "assistant", "content": "Yes."}]}) + "\n"
                            for i in range(8)))
    args = ["--model_name_or_path", str(model), "--dataset", str(chat), "--chat_template", "chatml",
            "--eval_fraction", "0", "--output_dir", str(tmp_path / "out")]
    assert prepare(args).cfg.data.packing == "none"
    with pytest.raises(HftkError) as err:
        prepare([*args, "--packing", "bfd"])
    assert err.value.field == "data.packing" and "without the position ids" in err.value.problem
