"""Preference rows: TRL's formats accepted, anything else refused naming the row and the expected fields; TRL's
tokenisation held to max_length as data.truncation says, with one summary line."""

from __future__ import annotations

import datasets
import pytest

from hftk.core.errors import HftkError
from hftk.data.preference import check_preference_rows, fit_pairs, tokenize_pairs


def _rows(**columns):
    return datasets.Dataset.from_dict(columns)


def test_trl_formats_are_accepted() -> None:
    assert check_preference_rows(_rows(prompt=["a"], chosen=["b"], rejected=["c"]), "p") == "standard"
    assert check_preference_rows(_rows(chosen=["a b"], rejected=["a c"]), "p") == "standard"  # implicit prompt
    msgs = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    assert check_preference_rows(_rows(prompt=[[{"role": "user", "content": "q"}]], chosen=[msgs("y")],
                                       rejected=[msgs("n")]), "p") == "conversational"


@pytest.mark.parametrize("columns, words", [
    ({"text": ["hello"]}, "row 0 has columns ['text']"),
    ({"prompt": ["a", "a"], "chosen": ["b", ""], "rejected": ["c", "d"]}, "row 1: 'chosen' is empty"),
    ({"prompt": ["a"], "chosen": ["b"], "rejected": ["b"]}, "row 0: 'chosen' equals 'rejected'"),
    ({"prompt": ["a", None], "chosen": ["b", "c"], "rejected": ["c", "d"]}, "row 1: 'prompt' is NoneType"),
])
def test_non_preference_rows_are_refused(columns, words) -> None:
    with pytest.raises(HftkError, match=words.replace("[", r"\[").replace("]", r"\]")) as info:
        check_preference_rows(_rows(**columns), "prefs.jsonl")
    assert info.value.field == "data.dataset" and "\n" not in str(info.value)


def _pairs(path, rows: int, tag: str, extra: bool = False, messages: bool = False):
    import json

    with path.open("w") as f:
        for i in range(rows):
            chosen, rejected = f"{tag} yes {i}", f"{tag} no {i}"
            if messages:
                row = {"prompt": [{"role": "user", "content": f"{tag} {i}?"}],
                       "chosen": [{"role": "assistant", "content": chosen}],
                       "rejected": [{"role": "assistant", "content": rejected}]}
            else:
                row = {"prompt": f"{tag} {i}?", "chosen": chosen, "rejected": rejected}
            f.write(json.dumps({**row, **({"score": i} if extra else {})}) + "\n")
    return path


def _sources(tmp_path, yaml_datasets: str, *argv: str):
    from hftk.config.options import load_config
    from hftk.data.preference import load_preference_sources

    config = tmp_path / "run.yaml"
    config.write_text("data:\n  datasets:\n" + yaml_datasets)
    return load_preference_sources(load_config(["--config", str(config), "--method", "dpo", *argv]).data)


def test_several_preference_datasets_mix_as_supervised_data_does(tmp_path) -> None:
    """Weights: interleaved by datasets' own interleave_datasets (seeded); no weights: concatenated. Columns
    beyond the pair (a score) are dropped so they concatenate; held-out rows are concatenated."""
    from hftk.data.dataset import split_rows
    from hftk.data.dataset import split_and_mix

    a, b = _pairs(tmp_path / "a.jsonl", 40, "a", extra=True), _pairs(tmp_path / "b.jsonl", 20, "b")
    weighted = _sources(tmp_path, f"    - path: {a}\n      weight: 3\n    - path: {b}\n", "--eval_fraction", "0.1")
    assert [s.weight for s in weighted] == [3.0, 1.0]
    train, held_out = split_and_mix(weighted, seed=5)
    parts = [split_rows(s.cfg, s.raw, 5) for s in weighted]
    expected = datasets.interleave_datasets([p[0] for p in parts], probabilities=[0.75, 0.25], seed=5)
    assert list(train["chosen"]) == list(expected["chosen"]) and train.column_names == ["prompt", "chosen", "rejected"]
    assert {c.split()[0] for c in train["chosen"]} == {"a", "b"}
    assert list(held_out["chosen"]) == list(parts[0][1]["chosen"]) + list(parts[1][1]["chosen"])
    plain = _sources(tmp_path, f"    - {a}\n    - {b}\n", "--eval_fraction", "0")
    train, held_out = split_and_mix(plain, seed=5)
    assert list(train["chosen"]) == [f"a yes {i}" for i in range(40)] + [f"b yes {i}" for i in range(20)] and held_out is None


def test_preference_datasets_of_different_formats_are_refused_by_name(tmp_path) -> None:
    a, b = _pairs(tmp_path / "a.jsonl", 4, "a"), _pairs(tmp_path / "b.jsonl", 4, "b", messages=True)
    with pytest.raises(HftkError) as info:
        _sources(tmp_path, f"    - {a}\n    - {b}\n")
    assert info.value.field == "data.datasets[1]"
    assert "holds conversational pairs" in info.value.problem and "standard ones" in info.value.problem


@pytest.mark.parametrize("messages", [False, True], ids=["standard", "conversational"])
def test_held_out_prompts_of_implicit_prompt_pairs_are_the_shared_start_trl_splits_off(tmp_path, messages) -> None:
    """--num_eval_samples on pairs without a 'prompt' column: the prompt TRL's extract_prompt finds (the longest
    shared start; for conversations, the turns before the answer)."""
    import json

    from trl.data_utils import extract_prompt

    from hftk.data.dataset import heldout_prompts

    path = tmp_path / "implicit.jsonl"
    with path.open("w") as f:
        for i in range(10):
            if messages:
                ask = [{"role": "user", "content": f"Colour {i}?"}]
                row = {"chosen": [*ask, {"role": "assistant", "content": "Blue."}],
                       "rejected": [*ask, {"role": "assistant", "content": "Green."}]}
            else:
                row = {"chosen": f"Sky {i} is blue.", "rejected": f"Sky {i} is green."}
            f.write(json.dumps(row) + "\n")
    sources = _sources(tmp_path, f"    - {path}\n", "--eval_fraction", "0.3")
    assert sources[0].fmt.endswith("_implicit_prompt")
    prompts = heldout_prompts(sources, 2, 42)
    held_out = split_rows_of(sources[0])
    assert len(prompts) == 2 and prompts == [extract_prompt(dict(row))["prompt"] for row in held_out.select(range(2))]
    assert prompts[0] == (held_out[0]["chosen"][:1] if messages else held_out[0]["chosen"].rsplit(" ", 1)[0])


def split_rows_of(source):
    from hftk.data.dataset import split_rows

    return split_rows(source.cfg, source.raw, 42)[1]


@pytest.fixture(scope="module")
def tokenized_pairs():
    """Three pairs through TRL's own tokenisation at max_length 12 (gpt2-tiny's tokenizer): one short, one
    whose prompt nearly fills it, one whose chosen completion is long; and a fourth that TRL itself drops."""
    from transformers import AutoTokenizer
    from trl import DPOConfig

    from hftk.data.builtin import materialize_model

    tokenizer = AutoTokenizer.from_pretrained(materialize_model("builtin:gpt2-tiny"))
    rows = _rows(prompt=["In the", "In the beginning God created the heaven and the earth and", "And",
                         "In the beginning God created the heaven and the earth and the earth was without form"],
                 chosen=[" beginning was", " the earth was",
                         " God said let there be light and there was light and God saw the light that it was good", " a"],
                 rejected=[" end", " no", " no", " b"])
    args = DPOConfig(output_dir="unused", max_length=12, report_to="none", use_cpu=True)
    return tokenize_pairs(rows, tokenizer, args, "train")


def _long(pairs, max_length: int) -> list[int]:
    return [i for i in range(len(pairs))
            if len(pairs["prompt_ids"][i]) + max(len(pairs["chosen_ids"][i]), len(pairs["rejected_ids"][i])) > max_length]


def test_trl_tokenises_and_drops_a_prompt_that_fills_max_length(tokenized_pairs) -> None:
    assert len(tokenized_pairs) == 3 and set(tokenized_pairs.column_names) >= {"prompt_ids", "chosen_ids", "rejected_ids"}
    assert _long(tokenized_pairs, 12) == [1, 2]  # the fixture's premise


def test_drop_removes_every_pair_longer_than_max_length_and_says_so_once(tokenized_pairs, capsys) -> None:
    kept = fit_pairs(tokenized_pairs, 4, 12, "drop", "train", announce=True)
    assert kept["prompt"] == ["In the"] and _long(kept, 12) == []
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["hftk: data: [train]: dropped 3 of 4 preference pairs longer than max_length 12 "
                     "(data.truncation=drop)"]
    fit_pairs(tokenized_pairs, 4, 12, "drop", "train", announce=False)  # other ranks: silent
    assert capsys.readouterr().out == ""


def test_truncate_keeps_them_for_trls_collator_and_counts_both(tokenized_pairs, capsys) -> None:
    kept = fit_pairs(tokenized_pairs, 4, 12, "truncate", "eval", announce=True)
    assert len(kept) == 3
    assert capsys.readouterr().out.strip() == (
        "hftk: data: [eval]: truncated 2 (their completions cut short, without EOS), dropped 1 (the prompt fills "
        "max_length: no completion token left) of 4 preference pairs longer than max_length 12 (data.truncation=truncate)")


def test_pairs_that_fit_pass_silently_and_a_split_left_empty_is_an_error(tokenized_pairs, capsys) -> None:
    assert len(fit_pairs(tokenized_pairs, 3, 64, "drop", "train", announce=True)) == 3
    assert capsys.readouterr().out == ""
    with pytest.raises(HftkError, match="every train preference pair is longer than max_length 3") as info:
        fit_pairs(tokenized_pairs, 3, 3, "drop", "train", announce=False)
    assert info.value.field == "training.max_length" and "--truncation truncate" in info.value.fix
