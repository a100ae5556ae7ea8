"""Preference rows: TRL's formats accepted, anything else refused naming the row and the expected fields."""

from __future__ import annotations

import datasets
import pytest

from hftk.core.errors import HftkError
from hftk.data.preference import check_preference_rows


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
    from hftk.data.preference import preference_rows

    a, b = _pairs(tmp_path / "a.jsonl", 40, "a", extra=True), _pairs(tmp_path / "b.jsonl", 20, "b")
    weighted = _sources(tmp_path, f"    - path: {a}\n      weight: 3\n    - path: {b}\n", "--eval_fraction", "0.1")
    assert [s.weight for s in weighted] == [3.0, 1.0]
    train, held_out = preference_rows(weighted, seed=5)
    parts = [split_rows(s.cfg, s.raw, 5) for s in weighted]
    expected = datasets.interleave_datasets([p[0] for p in parts], probabilities=[0.75, 0.25], seed=5)
    assert list(train["chosen"]) == list(expected["chosen"]) and train.column_names == ["prompt", "chosen", "rejected"]
    assert {c.split()[0] for c in train["chosen"]} == {"a", "b"}
    assert list(held_out["chosen"]) == list(parts[0][1]["chosen"]) + list(parts[1][1]["chosen"])
    plain = _sources(tmp_path, f"    - {a}\n    - {b}\n", "--eval_fraction", "0")
    train, held_out = preference_rows(plain, seed=5)
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
