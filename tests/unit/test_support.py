"""The support table (hftk/support.py): the README shows exactly what it renders, and the validators
refuse exactly what it says (tests/integration/test_matrix.py runs every cell it says trains)."""

from __future__ import annotations

import pytest

from hftk import support
from hftk.errors import HftkError
from tests.helpers import ROOT


def test_readme_support_table_is_the_rendered_one():
    readme = (ROOT / "README.md").read_text()
    assert support.with_table(readme) == readme, "regenerate it: python -m hftk.support README.md"
    assert "| sp | refused [6] |" in readme  # the rendering itself, read by eye once


def test_every_strategy_and_family_has_a_row_and_a_column():
    from hftk.families import FAMILIES
    from hftk.strategies import STRATEGIES

    table = support.render_markdown()
    assert [line.split(" | ")[0][2:] for line in table.splitlines()[2:2 + len(STRATEGIES)]] == list(STRATEGIES)
    assert table.splitlines()[0].count("|") == len(FAMILIES) + 3  # + the quantized-base column


@pytest.mark.parametrize("strategy", support.STRATEGIES)
def test_lora_refusal_comes_from_the_table(strategy):
    if support.expected(strategy, "llama", True) is None:
        support.check_lora(strategy, 8)  # no refusal
        return
    with pytest.raises(HftkError) as err:
        support.check_lora(strategy, 8)
    assert err.value.field == "model.lora_r" and strategy in err.value.problem
    support.check_lora(strategy, 0)  # full fine-tuning is not refused


def test_family_refusal_names_the_supported_families():
    with pytest.raises(HftkError, match="llama, mistral, qwen2"):
        support.check_family("sp", "gpt2")
    support.check_family("sp", "qwen2")
    support.check_family("ddp", "gpt2")


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
