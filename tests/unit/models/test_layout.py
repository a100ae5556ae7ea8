"""The decoder layout is read on the family's own model, whatever wraps it (PEFT, DDP)."""

from __future__ import annotations

import pytest
import torch.nn as nn
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from hftk.models.layout import block_modules, layout
from hftk.models.support_table import MATRIX_FAMILIES

SIZES = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 128, "head_dim": 8, "pad_token_id": 0}
GPT2_SIZES = {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 128}


def tiny(model_type: str) -> nn.Module:
    sizes = GPT2_SIZES if model_type == "gpt2" else dict(SIZES)
    if model_type == "gpt_neox":
        sizes.pop("num_key_value_heads")
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **sizes))


@pytest.mark.parametrize("model_type", MATRIX_FAMILIES)
def test_layout_of_a_peft_wrapped_model_is_the_base_models(model_type):
    model = tiny(model_type)
    plain = layout(model)
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules="all-linear"))
    found = layout(wrapped)
    assert found.backbone is plain.backbone
    assert found.before == plain.before and found.after == plain.after and found.head is plain.head
    assert list(found.blocks) == list(plain.blocks) and len(found.blocks) == 2
    assert block_modules(wrapped) == list(plain.blocks)


def test_layout_sees_through_a_module_wrapper():
    model = tiny("llama")

    class Wrapper(nn.Module):  # the shape of DDP / a DeepSpeed engine: the model under .module
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    assert layout(Wrapper(model)).backbone is model.model
