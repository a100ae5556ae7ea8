"""The model-family table (hftk.config.family_table): every row names modules its family's model really has."""

from __future__ import annotations

import pytest

from hftk.config.family_table import FAMILIES
from tests.unit.models.test_layout import tiny


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_family_row_names_modules_its_model_has(model_type):
    """One row of families.FAMILIES per family: its LoRA targets exist in a real model of the family
    and its display name is what the README's support table shows."""
    from hftk.config.options import ModelConfig
    from hftk.config.support import render_markdown
    from hftk.models.lora import target_modules

    model = tiny(model_type)
    leaves = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    assert set(target_modules(ModelConfig(), model_type)) <= leaves
    assert f" {FAMILIES[model_type].name} |" in render_markdown().splitlines()[0]
