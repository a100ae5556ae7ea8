"""GRPO's prompt rows: TRL's two formats accepted and every other row refused naming it; datasets mixed only with one
format and the same columns; prompts longer than block_size (rendered as TRL renders them) dropped with one line."""

from __future__ import annotations

import json

import datasets
import pytest

from hftk.core.errors import HftkError
from hftk.data.prompts import check_prompt_rows, fit_prompts, load_prompt_sources, prompt_lengths

USER = [{"role": "user", "content": "What is 2 + 2?"}]


def _rows(**columns):
    return datasets.Dataset.from_dict(columns)


def test_strings_and_message_lists_are_trls_formats() -> None:
    assert check_prompt_rows(_rows(prompt=["2 + 2 =", "3 + 1 ="], answer=["4", "4"]), "p") == "standard"
    assert check_prompt_rows(_rows(prompt=[USER]), "p") == "conversational"


@pytest.mark.parametrize("columns, words", [
    ({"text": ["a b c"]}, "p has columns ['text'], no 'prompt'. Fix: --method grpo needs a 'prompt' column"),
    ({"prompt": ["", "x"]}, "p row 0: 'prompt' is empty."),
    ({"prompt": ["x", None]}, "p row 1: 'prompt' is missing (null)."),
    ({"prompt": [5]}, "p row 0: 'prompt' is int."),
    ({"prompt": [[{"role": "user"}]]}, "p row 0: 'prompt' holds {'role': 'user'}, not a {role, content} message."),
    ({"prompt": [[]]}, "p row 0: 'prompt' is an empty message list."),
])
def test_other_rows_are_refused_by_row(columns, words) -> None:
    with pytest.raises(HftkError) as info:
        check_prompt_rows(_rows(**columns), "p")
    assert info.value.field == "data.dataset" and words in info.value.one_line(), info.value.one_line()


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_datasets_mix_with_one_format_and_the_same_columns(tmp_path) -> None:
    from hftk.config.options import load_config

    a = _jsonl(tmp_path / "a.jsonl", [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(8)])
    b = _jsonl(tmp_path / "b.jsonl", [{"prompt": f"{i} + 2 =", "answer": str(i + 2)} for i in range(4)])
    sources = load_prompt_sources(load_config(["--dataset", f"{a},{b}"]).data)
    assert [s.fmt for s in sources] == ["prompt_standard"] * 2
    c = _jsonl(tmp_path / "c.jsonl", [{"prompt": "1 + 1 =", "solution": "2"}] * 4)
    with pytest.raises(HftkError) as info:
        load_prompt_sources(load_config(["--dataset", f"{a},{c}"]).data)
    assert info.value.field == "data.dataset" and "give every dataset one prompt format and the same columns" in \
        info.value.fix and "['answer', 'prompt']" in info.value.problem


def test_long_prompts_are_dropped_with_one_line_as_trl_renders_them(tmp_path, capsys) -> None:
    from hftk.config.options import load_config
    from hftk.models.loading import load_tokenizer

    rows = [{"prompt": "word " * n} for n in (2, 3, 30, 4)]
    cfg = load_config(["--dataset", _jsonl(tmp_path / "p.jsonl", rows), "--model_name_or_path", "builtin:gpt2-tiny"])
    tokenizer = load_tokenizer(cfg.model)
    lengths = prompt_lengths([r["prompt"] for r in rows], tokenizer)
    assert lengths == [len(tokenizer(r["prompt"])["input_ids"]) for r in rows]  # TRL: processing_class(text=prompts)
    sources = load_prompt_sources(cfg.data)
    fit_prompts(sources, tokenizer, block_size=10, announce=True)
    assert [r["prompt"] for r in sources[0].raw["train"]] == ["word " * n for n in (2, 3, 4)]
    assert capsys.readouterr().out == (f"hftk: data: [{tmp_path / 'p.jsonl'} (train)]: dropped 1 of 4 prompts longer "
                                       f"than data.block_size 10 tokens (longest {max(lengths)})\n")
    with pytest.raises(HftkError) as info:
        fit_prompts(sources, tokenizer, block_size=1, announce=False)
    assert info.value.field == "data.block_size" and f"raise --block_size to at least {min(lengths[:2])}" in \
        info.value.fix


def test_message_lists_render_through_the_chat_template_or_say_why_not(tmp_path) -> None:
    from hftk.config.options import load_config
    from hftk.models.loading import load_tokenizer

    path = _jsonl(tmp_path / "chat.jsonl", [{"prompt": USER}] * 3)
    cfg = load_config(["--dataset", path, "--model_name_or_path", "builtin:gpt2-tiny"])
    sources = load_prompt_sources(cfg.data)
    with pytest.raises(HftkError, match="the chat template cannot render its prompts") as info:
        fit_prompts(sources, load_tokenizer(cfg.model), 64, announce=False)
    assert "--chat_template" in info.value.fix
    templated = load_tokenizer(cfg.model, "chatml", add_chat_tokens=False)
    fit_prompts(sources, templated, 64, announce=False)  # rendered with the generation prompt: kept
    assert len(sources[0].raw["train"]) == 3
