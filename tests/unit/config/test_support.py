"""The strategy rules (hftk/config/support.py): the validators refuse exactly what they say (the README's table:
tests/unit/models/test_support_table.py); packing ``auto`` resolves by data format and strategy, and a packing a
strategy cannot honour is refused before launch."""

from __future__ import annotations

import pytest

from hftk.config import support
from hftk.core.errors import HftkError


@pytest.mark.parametrize("strategy", support.STRATEGIES)
def test_lora_refusal_comes_from_the_table(strategy):
    if strategy not in support.LORA_REFUSED:
        support.check_lora(strategy, 8)  # no refusal
        return
    with pytest.raises(HftkError) as err:
        support.check_lora(strategy, 8)
    assert err.value.field == "model.lora_r" and strategy in err.value.problem
    support.check_lora(strategy, 0)  # full fine-tuning is not refused


@pytest.mark.parametrize("strategy", support.STRATEGIES)
def test_quantized_base_refusal_comes_from_the_table(strategy):
    if strategy in support.QUANT_STRATEGIES:
        support.check_quantized(strategy, "model.load_in_4bit")  # no refusal
        return
    with pytest.raises(HftkError) as err:
        support.check_quantized(strategy, "model.load_in_8bit")
    assert err.value.field in ("model.load_in_8bit", "model.lora_r")  # tp / cp / sp: LoRA itself is refused
    assert err.value.problem == support.QUANT_REFUSED[strategy].problem
    support.check_quantized(strategy, None)  # an unquantized base is not refused


def chat_data(tmp_path) -> str:
    import json

    rows_ = [{"messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": "Yes." * i}]}
             for i in range(1, 9)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    return str(path)


CHAT = ["--model_name_or_path", "builtin:gpt2-tiny", "--chat_template", "chatml", "--block_size", "128",
        "--eval_fraction", "0"]


@pytest.mark.parametrize("args,packing", [
    ([], "bfd"),  # conversations under a Trainer strategy
    (["--strategy", "pipeline", "--pp_size", "2"], "bfd"),  # the stages build the packed mask
    (["--strategy", "pipeline", "--pp_size", "2", "--attn_implementation", "flash_attention_2"], "none"),
    (["--strategy", "sp", "--sp_size", "2", "--model_name_or_path", "builtin:llama-tiny"], "none"),
    (["--packing", "none", "--pad_to_multiple_of", "8"], "none"),
])
def test_auto_packing_resolves_by_format_and_strategy(tmp_path, monkeypatch, args, packing):
    from hftk.run.prepare import prepare
    from tests.helpers import TWO_RANKS

    for key, value in TWO_RANKS.items():
        monkeypatch.setenv(key, value)
    p = prepare([*CHAT, "--dataset", chat_data(tmp_path), *args, "--output_dir", str(tmp_path / "o")])
    assert p.cfg.data.packing == packing and all(s.cfg.packing == packing for s in p.sources)
    text = prepare(["--model_name_or_path", "builtin:gpt2-tiny", "--output_dir", str(tmp_path / "t")])
    assert text.cfg.data.packing == "concat"


@pytest.mark.parametrize("args,field,words", [
    (["--strategy", "pipeline", "--pp_size", "2", "--packing", "bfd", "--attn_implementation", "flash_attention_2"],
     "model.attn_implementation", "strategy pipeline (its batches are rows of block_size)"),
    (["--strategy", "tp", "--tp_size", "2", "--packing", "bfd", "--attn_implementation", "flash_attention_2"],
     "model.attn_implementation", "strategy tp"),
    (["--strategy", "sp", "--sp_size", "2", "--packing", "bfd"], "data.packing", "Ulysses attention"),
    (["--strategy", "cp", "--cp_size", "2", "--packing", "bfd"], "data.packing", "ring attention"),
    (["--packing", "bfd", "--attn_implementation", "flex_attention"], "model.attn_implementation", "flex_attention"),
    (["--packing", "concat"], "data.packing", "attends to the one before"),
    (["--packing", "none", "--pad_to_multiple_of", "0"], "data.pad_to_multiple_of", "between 1 and data.block_size"),
])
def test_packing_a_strategy_cannot_honour_is_refused_before_launch(tmp_path, monkeypatch, args, field, words):
    from hftk.core.errors import HftkError
    from hftk.run.prepare import prepare
    from tests.helpers import TWO_RANKS

    for key, value in TWO_RANKS.items():
        monkeypatch.setenv(key, value)
    model = ["--model_name_or_path", "builtin:llama-tiny"] if "--strategy" in args and args[1] in ("sp", "cp", "tp") else []
    with pytest.raises(HftkError) as err:
        prepare([*CHAT, *model, "--dataset", chat_data(tmp_path), *args, "--output_dir", str(tmp_path / "o")])
    assert err.value.field == field and words in err.value.problem
