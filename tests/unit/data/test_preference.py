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
