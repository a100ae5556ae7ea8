"""The README's support table (hftk/models/support_table.py): the README shows exactly what it renders, every
strategy has a row and every claimed family a column, the DPO column says what check_method does (every cell is
run by tests/integration/test_matrix.py)."""

from __future__ import annotations

import pytest

from hftk.config import support
from hftk.core.errors import HftkError
from hftk.models import support_table
from tests.helpers import ROOT


def test_readme_support_table_is_the_rendered_one():
    readme = (ROOT / "README.md").read_text()
    assert support_table.with_table(readme) == readme, "regenerate it: python -m hftk.models.support_table README.md"
    assert "| cp | full; LoRA refused [" in readme  # the rendering itself, read by eye once


def test_every_strategy_and_family_has_a_row_and_a_column():
    table = support_table.render_markdown()
    rows = table.splitlines()
    assert [line.split(" | ")[0][2:] for line in rows[2:2 + len(support.STRATEGIES)]] == list(support.STRATEGIES)
    assert rows[0].count("|") == len(support_table.MATRIX_FAMILIES) + 5  # + the quantized-base, DPO, GRPO columns
    for family in ("GPT-2", "Qwen3", "Gemma 3", "Phi-3", "OLMo 2", "SmolLM3"):
        assert f" {family} |" in rows[0]


def test_dpo_column_says_what_check_method_does():
    rows = support_table.render_markdown().splitlines()[2:2 + len(support.STRATEGIES)]
    for strategy, row in zip(support.STRATEGIES, rows, strict=True):
        dpo = row.split(" | ")[-2]
        if strategy in support.DPO_REFUSED:
            assert dpo.startswith("refused ["), row
        elif strategy in support.DPO_LORA_REFUSED:
            assert dpo.startswith("full; LoRA refused ["), row
        elif strategy in support.QUANT_REFUSED:
            assert dpo == "full, LoRA", row
        else:  # QLoRA where a quantized base trains and DPO's LoRA does (tests/integration/test_dpo.py: ddp)
            assert dpo == "full, LoRA, QLoRA", row


def test_grpo_column_says_what_check_method_does():
    rows = support_table.render_markdown().splitlines()[2:2 + len(support.STRATEGIES)]
    for strategy, row in zip(support.STRATEGIES, rows, strict=True):
        grpo = row.split(" | ")[-1].removesuffix(" |")
        if strategy in support.GRPO_REFUSED:
            assert grpo.startswith("refused ["), row
            with pytest.raises(HftkError, match=f"grpo is not supported with strategy {strategy}"):
                support.check_method(strategy, "grpo")
        else:  # full and LoRA train (tests/integration/test_grpo.py); a quantized base is refused by name
            assert grpo == "full, LoRA", row
            support.check_method(strategy, "grpo", 8)
            with pytest.raises(HftkError, match="not supported with --method grpo") as err:
                support.check_method(strategy, "grpo", 8, quantized_field="model.load_in_4bit")
            assert err.value.field == "model.load_in_4bit"


def test_a_family_cell_is_the_refusal_its_strategy_validator_raises():
    """The table's refusals are the spec's: a sliding-window family under cp names its window."""
    refusal = support_table.expected("cp", "mistral", False)
    assert refusal.field == "model.model_name_or_path" and "sliding_attention" in refusal.problem
    assert support_table.expected("pipeline", "gemma3_text", True) is None
    assert support_table.expected("tp", "qwen3", True) == support.LORA_REFUSED["tp"]
