"""``hftk preprocess --method dpo``: TRL's tokenised pairs written once, read back by a DPO run as TRL itself
tokenises them, and refused by name when the folder was made for another method or max_length."""

from __future__ import annotations

import json

from hftk.cli import main as hftk
from hftk.run.prepare import prepare


def _pairs(path, rows: int):
    with path.open("w") as f:
        for i in range(rows):
            f.write(json.dumps({"prompt": f"Repeat {i}:", "chosen": f" {i} {i}", "rejected": f" {i + 1}"}) + "\n")
    return str(path)


def test_dpo_pairs_preprocessed_once_equal_trls_tokenisation_and_are_refused_by_another_config(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from hftk.data.builtin import materialize_model
    from hftk.data.dataset import split_and_mix

    data = _pairs(tmp_path / "prefs.jsonl", 10)
    args = ["--method", "dpo", "--dataset", data, "--eval_fraction", "0.2", "--output_dir", str(tmp_path / "out")]
    folder = tmp_path / "tok"
    assert hftk(["preprocess", *args, "--tokenized_path", str(folder)]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("hftk: preprocess:")]
    assert len(line) == 1 and line[0].startswith("hftk: preprocess: preference_standard; train: 8 pairs"), line
    assert "eval: 2 pairs" in line[0]
    run = prepare([*args, "--tokenized_path", str(folder)])
    assert run.sources == [] and run.tokenized.eval is not None
    # what TRL's own DPOTrainer makes of the same rows, split as a run splits them (the run's seed)
    raw = prepare(args)
    train, _ = split_and_mix(raw.sources, int(raw.cfg.args.seed))
    model = materialize_model("builtin:gpt2-tiny")
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model),
                         args=DPOConfig(output_dir=str(tmp_path / "trl"), max_length=raw.cfg.data.block_size,
                                        report_to="none", use_cpu=True, bf16=False),
                         train_dataset=train, processing_class=AutoTokenizer.from_pretrained(model))
    theirs = trainer.train_dataset
    for column in ("prompt_ids", "chosen_ids", "rejected_ids"):
        assert run.tokenized.train[column] == theirs[column], column
    assert not (tmp_path / "out").exists()
    capsys.readouterr()
    sft = tmp_path / "sft_tok"
    assert hftk(["preprocess", "--dataset", _text(tmp_path), "--tokenized_path", str(sft),
                 "--output_dir", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    for argv, text in [([*args, "--tokenized_path", str(folder), "--max_length", "32"], "another max_length (128, this run: 32)"),
                       ([*args[2:], "--tokenized_path", str(folder)], "another method ('dpo', this run: 'sft')"),
                       ([*args, "--tokenized_path", str(sft)], "another method ('sft', this run: 'dpo')")]:
        assert hftk(["train", *argv]) == 2
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(err) == 1 and "data.tokenized_path" in err[0] and text in err[0], err
    assert not (tmp_path / "out").exists()


def _text(tmp_path) -> str:
    path = tmp_path / "text.jsonl"
    path.write_text("".join(json.dumps({"text": "In the beginning God created the heaven and the earth. " * 4}) + "\n"
                            for _ in range(20)))
    return str(path)
